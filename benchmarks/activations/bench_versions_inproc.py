"""Two source trees of ``offload`` in one process, steps alternating: old against new.

Command (one H100: hooks and tiny48 take about two minutes, ref8l about as long again)::

    mkdir -p .old && git archive <old commit> offload | tar -x -C .old
    PYTHONPATH=. python3 benchmarks/activations/bench_versions_inproc.py --old .old \\
        --out benchmarks/results/versions_inproc.json

CPU smoke run (tiny sizes; the numbers mean little; about 20 seconds)::

    PYTHONPATH=. python3 benchmarks/activations/bench_versions_inproc.py --old . \\
        --device cpu --quick --rounds 6 --warmup 2 --out /tmp/versions_inproc.json

Why one process: small models are host-bound, and a host's speed drifts between
processes by more than the differences being measured (``bench_versions.py`` runs each
tree in processes of its own; there the tiny48 ratios of one tree moved by 20 % from
one process to the next). Here both trees' offloaders wrap the same layers, and each
round times one step of every row (no offloading, then each configuration with the old
and the new tree; the order reversed every other round), so drift reaches every row
alike.

How both trees load at once: the old tree's ``offload/`` package is copied to a
temporary folder as ``offload_old/`` with its absolute imports of ``offload`` renamed
(checked to import from there); the new tree is the ``offload`` of ``--new`` (default
the repository root). Only the public API both trees share is used:
``ActivationOffloader(layers, offload_layers=..., min_tensor_bytes=...)`` as a context
manager around the forward.

Models (``--models``):

* ``hooks``: ``bench_hooks.py``'s model path: 64 layers of 16 ``torch.sin`` on a
  256-value fp32 input that requires grad (1,024 saved tensors of 1 KiB a step); one
  configuration, ``all`` (every layer offloaded, ``min_tensor_bytes=0``); loss
  ``y.sum()``. Also reported: ``us per saved tensor`` = (median step - median step
  of no offloading) * 1000 / 1,024, per tree.
* ``tiny48``: the new tree's ``offload.models.ReferenceModel`` at
  ``bench_activations.py``'s tiny48 sizes (48 layers, hidden 256, 4 heads, ffn 704,
  seq 256, batch 4, bf16; ``--quick``: 6 layers of its quick sizes and
  ``min_tensor_bytes=0``); configurations ``k0`` and ``k47`` (``offload_layers`` 0 and
  47, the default ``min_tensor_bytes``);
  a fresh bf16 input that does not require grad, loss mean of squares in fp32, gradients
  set to ``None`` first.
* ``ref8l``: the same model at ``bench_activations.py``'s ref-8L sizes (8 layers,
  hidden 4096, ffn 14336, seq 4096, bf16; ``--quick``: its quick sizes and
  ``min_tensor_bytes=0``); configurations ``auto``, ``k1``, ``k2``, ``k4``, ``k7`` and
  ``checkpoint`` (every layer through a ``CheckpointOffloader`` of the tree, what
  ``offload.checkpoint`` runs); input and
  loss as tiny48's. Device bound: this is the row where a slower tree would show in
  the step's time on the device, not on the host.

A step is host wall clock of forward, loss and backward between device
synchronisations, Python's garbage collector off (these models are host-bound: the
device waits for the host). Per configuration and tree, after ``--warmup`` rounds: the
median step, the ratio to the median step without offloading, and ``new/old`` (of the
medians) with ``paired``: the median over rounds of new step / old step. Every
offloaded step is checked to offload (``stats.bytes_offloaded`` > 0 where a layer is
selected, 0 for ``k0``; ``checkpoint`` by its ``CheckpointOffloader``'s stats; ``auto``
chooses for itself and is not checked).
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks._common import environment, gc_off, median, synchronize, write_json

ROOT = Path(__file__).resolve().parents[2]
TREES = ("old", "new")

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


class Model:
    """One model's layers, its step input and loss, and its configurations."""

    def __init__(self, name: str, device: torch.device, quick: bool) -> None:
        self.name = name
        torch.manual_seed(0)
        if name == "hooks":
            # imported once both trees are on sys.path (bench_hooks imports offload)
            from benchmarks.activations.bench_hooks import SinLayer

            n, ops = (4, 4) if quick else (64, 16)
            self.layers = nn.ModuleList(SinLayer(ops) for _ in range(n))
            self.x = torch.randn(256, device=device)
            self.saved = n * ops
            self.configs = {"all": {"offload_layers": n, "min_tensor_bytes": 0}}
        elif name in ("tiny48", "ref8l"):
            from benchmarks.activations.bench_activations import PRESETS, QUICK
            from offload.models import ReferenceModel

            s = QUICK if quick else PRESETS["tiny48" if name == "tiny48" else "ref-8L"][0]
            n = 6 if quick and name == "tiny48" else s.layers
            model = ReferenceModel(n, s.hidden, s.heads, s.ffn, device=device, dtype=torch.bfloat16)
            self.layers = model.layers
            self.shape = (s.batch, s.seq, s.hidden)
            self.device = device
            self.saved = None
            extra = {"min_tensor_bytes": 0} if quick else {}  # quick tensors are tiny
            ks: list[Any] = [0, n - 1] if name == "tiny48" else ["auto", 1, 2, 4, n - 1]
            self.configs = {f"k{k}" if k != "auto" else "auto": {"offload_layers": k, **extra}
                            for k in dict.fromkeys(ks)}  # fmt: skip
            if name == "ref8l":
                self.configs["checkpoint"] = {"checkpoint": True, **extra}
        else:
            raise SystemExit(f"--models: {name!r} is not one of hooks, tiny48, ref8l")
        self.through: Callable[..., torch.Tensor] | None = None  # a layer call's wrapper

    def loss(self) -> Callable[[], torch.Tensor]:
        """A closure computing one step's loss (its input made now, outside the timing)."""
        if self.name == "hooks":
            x = self.x.clone().requires_grad_(True)
            return lambda: self._run(x).sum()
        self.layers.zero_grad(set_to_none=True)
        x = torch.randn(self.shape, device=self.device, dtype=torch.bfloat16)
        return lambda: self._run(x).float().square().mean()

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) if self.through is None else self.through(layer, x)
        return x


class Checkpointing:
    """The ``checkpoint`` configuration of one tree: a context that sends every layer
    call of ``model`` through a ``CheckpointOffloader`` of the tree (what
    ``offload.checkpoint`` runs, at ``min_tensor_bytes`` where given) while entered."""

    def __init__(self, package: Any, model: Model, min_tensor_bytes: int | None) -> None:
        kwargs = {} if min_tensor_bytes is None else {"min_tensor_bytes": min_tensor_bytes}
        self.offloader, self.model = package.CheckpointOffloader(**kwargs), model

    def __enter__(self) -> Checkpointing:
        self.model.through = self.offloader.checkpoint
        self.offloader.reset_stats()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.model.through = None

    @property
    def stats(self) -> Any:
        """The checkpoint offloader's counters (``bytes_offloaded`` as an offloader's)."""
        return self.offloader.stats

    def close(self) -> None:
        self.offloader.close()


def timed_step(model: Model, off: Any, device: torch.device) -> float:
    loss = model.loss()
    gc.collect()
    synchronize(device)
    with gc_off():
        start = time.perf_counter()
        with off if off is not None else contextlib.nullcontext():
            value = loss()
        value.backward()
        synchronize(device)
        return (time.perf_counter() - start) * 1e3


def measure(model: Model, packages: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    offloaders: dict[tuple[str, str], Any] = {("none", ""): None}
    for config, kwargs in model.configs.items():
        for tree in TREES:
            if kwargs.get("checkpoint"):
                arm: Any = Checkpointing(packages[tree], model, kwargs.get("min_tensor_bytes"))
            else:
                arm = packages[tree].ActivationOffloader(model.layers, **kwargs)
            offloaders[(tree, config)] = arm
    order = list(offloaders)
    times: dict[tuple[str, str], list[float]] = {key: [] for key in order}
    for r in range(args.warmup + args.rounds):
        for key in order if r % 2 == 0 else order[::-1]:
            off = offloaders[key]
            elapsed = timed_step(model, off, device)
            if r >= args.warmup:
                times[key].append(elapsed)
            config = model.configs.get(key[1], {})
            if off is not None and config.get("offload_layers") != "auto":
                sent = off.stats.bytes_offloaded
                selects = config.get("checkpoint") or config["offload_layers"] > 0
                if (sent > 0) != bool(selects):
                    raise RuntimeError(f"{key}: {sent} bytes offloaded in a step")
    for off in offloaders.values():
        if off is not None:
            off.close()
    none = median(times[("none", "")])
    configs = {}
    for config in model.configs:
        row: dict[str, Any] = {}
        for tree in TREES:
            t = times[(tree, config)]
            row[tree] = {"step_ms": t, "step_ms_median": median(t), "ratio": median(t) / none}
            if model.saved is not None:
                row[tree]["us_per_saved"] = (median(t) - none) * 1e3 / model.saved
        row["new_over_old"] = row["new"]["step_ms_median"] / row["old"]["step_ms_median"]
        pairs = zip(times[("new", config)], times[("old", config)])
        row["paired"] = median([n / o for n, o in pairs])
        configs[config] = row
    return {"none_ms": times[("none", "")], "none_ms_median": none, "configs": configs}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", type=Path, required=True, help="a folder holding the old offload/")
    p.add_argument("--new", type=Path, default=ROOT, help="a folder holding the new offload/")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--models", default="hooks,tiny48,ref8l", help="comma-separated: hooks, tiny48, ref8l"
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    p.add_argument("--rounds", type=int, default=60, help="timed rounds (a step of each row)")
    p.add_argument("--warmup", type=int, default=10, help="rounds before the timed ones")
    p.add_argument("--out", type=Path, default=None, help="JSON output file")
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not args.models or args.rounds < 1 or args.warmup < 0:
        p.error("--models not empty, --rounds >= 1, --warmup >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if torch.device(args.device).type == "cpu":
        torch.set_num_threads(1)  # tiny ops
    new = args.new.resolve()
    with tempfile.TemporaryDirectory() as scratch:
        sys.path.insert(0, str(new))
        sys.path.insert(0, str(renamed_copy(args.old.resolve(), Path(scratch))))
        packages = {
            tree: importlib.import_module(n) for tree, n in zip(TREES, ("offload_old", "offload"))
        }
        files = {tree: Path(pkg.__file__).resolve() for tree, pkg in packages.items()}
        if Path(scratch).resolve() not in files["old"].parents:
            raise SystemExit(f"offload_old imported from {files['old']}")
        if new not in files["new"].parents:
            raise SystemExit(f"offload imported from {files['new']}, not from --new")
        device = torch.device(args.device)
        models = {
            name: measure(Model(name, device, args.quick), packages, args) for name in args.models
        }
    print(f"{'model':7s} {'config':10s} {'none ms':>8s} {'old ms':>8s} {'new ms':>8s} "
          f"{'old x':>6s} {'new x':>6s} {'new/old':>7s} {'paired':>6s}")  # fmt: skip
    for name, m in models.items():
        for config, row in m["configs"].items():
            o, n = row["old"], row["new"]
            print(
                f"{name:7s} {config:10s} {m['none_ms_median']:8.2f} {o['step_ms_median']:8.2f} "
                f"{n['step_ms_median']:8.2f} {o['ratio']:6.3f} {n['ratio']:6.3f} "
                f"{row['new_over_old']:7.3f} {row['paired']:6.3f}"
            )
            if "us_per_saved" in o:
                print(
                    f"{'':19s} us per saved tensor: old {o['us_per_saved']:.2f}, new {n['us_per_saved']:.2f}"
                )
    if args.out is not None:
        write_json(
            args.out,
            {
                "benchmark": "bench_versions_inproc",
                "command": sys.argv,
                "settings": {
                    k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                },
                "environment": environment(torch.device(args.device)),
                "versions": {t: getattr(p, "__version__", None) for t, p in packages.items()},
                "models": models,
            },
        )


if __name__ == "__main__":
    main()
