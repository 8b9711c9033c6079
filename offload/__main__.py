"""``python -m offload``: the command line of :mod:`offload.cli`."""

from offload.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
