"""``bench_hooks.py``'s model path for two source trees in one process, steps alternating.

Command (one H200; about a minute per run with the defaults)::

    mkdir -p .old && git archive 6a4478f offload | tar -x -C .old
    PYTHONPATH=. python3 benchmarks/activations/bench_hooks_versions.py --old .old \\
        --out $OUT/hooks_versions.json

CPU smoke run (the numbers mean little; about 20 seconds)::

    PYTHONPATH=. python3 benchmarks/activations/bench_hooks_versions.py --old . \\
        --device cpu --rounds 12 --warmup 2 --out /tmp/hooks_versions.json

Why one process: the model path's steps are host-bound (64 layers of 16 ``sin`` on 1 KiB
tensors, 1,024 saved tensors a step), and a host's speed drifts between processes by
more than the difference being measured (``bench_versions.py`` runs each tree in
processes of its own). Here both trees' offloaders wrap the same layers, and each round
times one step of each row (no offloading, the old tree, the new tree; the order
reversed every other round), so drift reaches every row alike.

How both trees load at once: the old tree's ``offload/`` package is copied to a
temporary folder as ``offload_old/`` with its absolute imports of ``offload`` renamed
(the copy is checked to import from there); the new tree is this checkout's ``offload``
(``--new``, default the repository root, is put first on ``sys.path``). Only the public
API both trees share is used: ``ActivationOffloader(layers, offload_layers=...,
min_tensor_bytes=0)`` as a context manager around the forward.

A step is as in ``bench_hooks.py``'s model path: host wall clock of forward +
``y.sum().backward()`` on a fresh input that requires grad, between device
synchronisations, Python's garbage collector off. Reported per tree: median and fastest
step (ms) after ``--warmup`` rounds, ``us per saved tensor`` = (median step - median step
of no offloading) * 1000 / saved tensors, and ``paired_us_per_tensor``: the median over
rounds of (new step - old step) * 1000 / saved tensors (negative: the new tree is
faster). Both offloaders must have offloaded every saved tensor
(``stats.bytes_offloaded`` = saved tensors x tensor bytes, checked).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]

#: absolute imports of the package, as the trees write them
_IMPORTS = (
    (re.compile(r"\bfrom offload(?=[. ])"), "from offload_old"),
    (re.compile(r"^(\s*)import offload(?=[. \n])", re.M), r"\1import offload_old"),
)


def renamed_copy(tree: Path, scratch: Path) -> Path:
    """Copy ``tree/offload`` to ``scratch/offload_old`` with its imports renamed; the
    folder to put on ``sys.path``."""
    src = tree / "offload"
    if not (src / "__init__.py").is_file():
        raise SystemExit(f"--old: {tree} holds no offload/ package")
    dst = scratch / "offload_old"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    for path in dst.rglob("*.py"):
        text = path.read_text()
        for pattern, repl in _IMPORTS:
            text = pattern.sub(repl, text)
        path.write_text(text)
    return scratch


class SinLayer(nn.Module):
    def __init__(self, ops: int) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.ops):
            x = torch.sin(x)
        return x


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(args: argparse.Namespace, packages: dict[str, Any]) -> dict[str, Any]:
    device = torch.device(args.device)
    layers = nn.ModuleList(SinLayer(args.ops) for _ in range(args.layers))
    x = torch.randn(args.numel, device=device)
    saved = args.layers * args.ops
    offloaders: dict[str, Any] = {"none": None}
    for name, pkg in packages.items():
        offloaders[name] = pkg.ActivationOffloader(
            layers, offload_layers=len(layers), min_tensor_bytes=0
        )
    order = list(offloaders)
    times: dict[str, list[float]] = {name: [] for name in order}
    for r in range(args.warmup + args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            off = offloaders[name]
            xi = x.clone().requires_grad_(True)
            gc.collect()
            synchronize(device)
            gc.disable()
            try:
                start = time.perf_counter()
                with off if off is not None else contextlib.nullcontext():
                    y = xi
                    for layer in layers:
                        y = layer(y)
                y.sum().backward()
                synchronize(device)
                elapsed = (time.perf_counter() - start) * 1e3
            finally:
                gc.enable()
            if r >= args.warmup:
                times[name].append(elapsed)
            if off is not None:
                want = saved * x.numel() * x.element_size()
                got = off.stats.bytes_offloaded
                if got != want:
                    raise RuntimeError(f"{name}: offloaded {got} bytes a step, expected {want}")
    for off in offloaders.values():
        if off is not None:
            off.close()
    med = {name: _median(t) for name, t in times.items()}
    rows = {
        name: {
            "step_ms": t,
            "step_ms_median": med[name],
            "step_ms_min": min(t),
            "us_per_saved": None if name == "none" else (med[name] - med["none"]) * 1e3 / saved,
        }
        for name, t in times.items()
    }
    paired = [(n - o) * 1e3 / saved for n, o in zip(times["new"], times["old"])]
    return {
        "saved_per_step": saved,
        "rows": rows,
        "paired_us_per_tensor": _median(paired),
        "new_over_old_us_per_saved": rows["new"]["us_per_saved"] / rows["old"]["us_per_saved"],
    }


def _median(values: Sequence[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", type=Path, required=True, help="a folder holding the old offload/")
    p.add_argument("--new", type=Path, default=ROOT, help="a folder holding the new offload/")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--ops", type=int, default=16)
    p.add_argument("--numel", type=int, default=256)
    p.add_argument("--rounds", type=int, default=100, help="timed rounds (a step of each row)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--out", type=Path, default=None, help="JSON output file")
    args = p.parse_args(argv)
    if min(args.layers, args.ops, args.numel, args.rounds) < 1 or args.warmup < 0:
        p.error("--layers, --ops, --numel and --rounds >= 1, --warmup >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        sys.path.insert(0, str(args.new.resolve()))
        sys.path.insert(0, str(renamed_copy(args.old.resolve(), Path(scratch))))
        packages = {
            "old": importlib.import_module("offload_old"),
            "new": importlib.import_module("offload"),
        }
        files = {name: str(Path(pkg.__file__).resolve()) for name, pkg in packages.items()}
        if not files["old"].startswith(str(Path(scratch).resolve())):
            raise SystemExit(f"offload_old imported from {files['old']}")
        if not files["new"].startswith(str(args.new.resolve())):
            raise SystemExit(f"offload imported from {files['new']}, not --new")
        result = measure(args, packages)
    from benchmarks._common import environment, write_json

    out = {
        "benchmark": "bench_hooks_versions",
        "command": sys.argv,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "environment": environment(torch.device(args.device)),
        "versions": {name: getattr(pkg, "__version__", None) for name, pkg in packages.items()},
        **result,
    }
    rows = result["rows"]
    print(f"{'row':6s} {'median ms':>10s} {'fastest ms':>11s} {'us/saved':>9s}")
    for name, row in rows.items():
        us = "" if row["us_per_saved"] is None else f"{row['us_per_saved']:9.2f}"
        print(f"{name:6s} {row['step_ms_median']:10.2f} {row['step_ms_min']:11.2f} {us}")
    print(
        f"new/old us per saved tensor: {result['new_over_old_us_per_saved']:.3f}; "
        f"paired (new - old) per tensor: {result['paired_us_per_tensor']:+.2f} us"
    )
    if args.out is not None:
        write_json(args.out, out)


if __name__ == "__main__":
    main()
