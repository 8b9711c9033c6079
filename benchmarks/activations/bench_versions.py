"""Two source trees of ``offload`` on one device, measured interleaved: old against new.

Command (one H200; about 4.5 minutes with the defaults, see "Time" below)::

    mkdir -p .old && git archive 6a4478f offload | tar -x -C .old
    PYTHONPATH=. python3 benchmarks/activations/bench_versions.py --old .old --new . \\
        --out $OUT/versions.json

CPU smoke run (tiny sizes, one round; the ratios mean nothing; about half a minute)::

    PYTHONPATH=. python3 benchmarks/activations/bench_versions.py --quick --device cpu \\
        --old . --new . --rounds 1 --out /tmp/versions.json

``--old`` and ``--new`` are folders that hold an ``offload/`` package (``.old`` above
holds the one of commit 6a4478f). Every measurement runs in a fresh process of this
script in worker mode with ``PYTHONPATH=<tree>:<repository root>``; the worker checks
that ``offload`` was imported from ``<tree>`` and uses only the public API both trees
share: ``offload.ActivationOffloader(layers, offload_layers=..., compress=...)`` as a
context manager around the forward and the loss, and ``offload.checkpoint(layer, x)``.
The model is the tree's ``offload.models.ReferenceModel`` (the driver records
whether the two trees' files are identical).

Models (``--presets``): ``ref-8L``: ``ReferenceModel(8, 4096, 32, 14336)``, bf16, batch
1, seq 4096; configurations ``none``, ``auto``, ``k1``, ``k2``, ``k4``, ``k7``,
``fp8-k4``, ``fp8-k7`` (``compress="fp8"``) and ``checkpoint`` (``offload.checkpoint``
around every layer). ``tiny48``: the sizes of ``bench_activations.py --preset tiny48``
(48 layers, hidden 256, 4 heads, ffn 704, seq 256, batch 4); ``k0`` (hooks only) and
``k47`` (every layer but the last). ``--quick``: tiny sizes of the same shape and
``min_tensor_bytes=0`` (``bench_activations.py --quick``).

A step (as in ``bench_activations.py``): gradients set to ``None``, a fresh random input
that does not require grad, forward + loss (mean of squares in fp32) + backward; its time
is the device time between CUDA events around it after a synchronisation
(``perf_counter`` on the CPU). Per configuration, in one process: ``--warmup`` steps of
no offloading and of the configuration (``auto``: more, until ``stats.auto["phase"]``
is ``"settled"`` where the tree reports phases, at most ``--auto-warmup``), then
``--blocks`` blocks of ``--steps`` steps each way, alternating (no offloading first in
even blocks): ``ratio`` = median of the configuration's steps / median of the
no-offloading steps of the same process. Then the activation peak of one step of each:
``torch.cuda.max_memory_allocated()`` during the step minus ``memory_allocated()`` just
before it (the previous step's gradients and the input included in "before").

The driver runs, for each of ``--rounds`` rounds, each preset's worker for the old then
the new tree (the order reversed every round; ``--per-config``: one process per
configuration instead of one per preset), writing the JSON after every worker. Then
``bench_hooks.py`` of this (new) checkout for both trees, ``--hooks-rounds`` times each,
alternating: the ``model`` rows go through the public API; its ``direct`` rows use the
scheduler's internals, and run on both layouts (``Step`` in ``_step.py`` or in the
former ``_scheduler.py``).

Report per configuration: old ratio and new ratio (medians over rounds), new/old, the
absolute step ms, the activation peaks (bytes; ``equal`` when every round of both trees
measured the same), and the verdict: ``ok`` when new/old is within ``--tolerance``
(2 %), else ``slower`` or ``faster``. For ``bench_hooks``: per row, the median over runs
of each tree's us per tensor and new/old.

Time (defaults, H200, from ``bench_activations.py`` step times: ref-8L about 90-200 ms a
step, tiny48 50-135 ms): per ref-8L worker about 8 configurations x ~20 steps plus
``auto``'s warm-up, ~25 s with process start; per tiny48 worker ~12 s; 3 rounds x 2
trees of both, ~3.7 min; ``bench_hooks`` (CUDA only, 11 repeats), 2 runs per tree,
~40 s.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]  # the repository root: ``benchmarks`` is importable from it
HOOKS = HERE.parent / "bench_hooks.py"
RESULT = "RESULT "  # the worker's line of JSON on stdout
WORKER_ONLY = ("out", "worker", "tree", "sizes", "min_tensor_bytes")

#: preset -> configurations (``none``, ``auto``, ``k<N>``, ``fp8-k<N>``, ``checkpoint``)
CONFIGS: dict[str, list[str]] = {
    "ref-8L": ["none", "auto", "k1", "k2", "k4", "k7", "fp8-k4", "fp8-k7", "checkpoint"],
    "tiny48": ["k0", "k47"],
}
QUICK_CONFIGS: dict[str, list[str]] = {
    "ref-8L": ["none", "auto", "k1", "k3", "fp8-k2", "checkpoint"],
    "tiny48": ["k0", "k5"],
}
#: ``bench_hooks.py`` arguments: on the device, and in the quick smoke run
HOOKS_ARGS = ["--repeats", "11", "--warmup", "3"]
QUICK_HOOKS_ARGS = ["--layers", "4", "--ops", "4", "--numel", "64", "--repeats", "3"]
QUICK_HOOKS_ARGS += ["--warmup", "1", "--direct-tensors", "64", "--direct-groups", "4"]


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


# --------------------------------------------------------------------------------------
# worker: one tree, one process (torch and the public API of ``offload`` only)


def parse_config(name: str) -> tuple[str, int | str | None, str | None]:
    """``(kind, offload_layers, compress)`` of a configuration name."""
    if name in ("none", "checkpoint"):
        return name, None, None
    if name == "auto":
        return "offload", "auto", None
    compress = None
    body = name
    if name.startswith("fp8-"):
        compress, body = "fp8", name[4:]
    if body.startswith("k") and body[1:].isdigit():
        return "offload", int(body[1:]), compress
    raise ValueError(f"configuration {name!r}: expected none, auto, k<N>, fp8-k<N> or checkpoint")


class Worker:
    """The model of one preset in one process, and the steps of its configurations."""

    def __init__(self, args: argparse.Namespace) -> None:
        import offload

        try:
            from offload.models import ReferenceModel
        except ImportError:  # a tree from before offload/models.py became public
            from offload._reference import ReferenceModel

        tree = Path(args.tree).resolve()
        self.offload_file = Path(offload.__file__).resolve()
        if tree not in self.offload_file.parents:
            raise SystemExit(f"worker: offload imported from {self.offload_file}, not from {tree}")
        self.offload = offload
        self.args = args
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.sizes = json.loads(args.sizes)
        s = self.sizes
        torch.manual_seed(0)
        model = ReferenceModel(
            s["layers"], s["hidden"], s["heads"], s["ffn"], device=self.device, dtype=torch.bfloat16
        )
        self.layers = model.layers

    def new_input(self) -> torch.Tensor:
        s = self.sizes
        shape = (s["batch"], s["seq"], s["hidden"])
        return torch.randn(shape, device=self.device, dtype=torch.bfloat16)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.float().square().mean()

    def runner(self, name: str) -> tuple[Callable[[torch.Tensor], torch.Tensor], Any]:
        """``(loss of one step's input, the offloader or None)`` of a configuration."""
        kind, k, compress = parse_config(name)
        if kind == "none":
            return self.forward, None
        if kind == "checkpoint":
            checkpoint = self.offload.checkpoint

            def checkpointed(x: torch.Tensor) -> torch.Tensor:
                for layer in self.layers:
                    x = checkpoint(layer, x)
                return x.float().square().mean()

            return checkpointed, None
        kwargs: dict[str, Any] = {"offload_layers": k}
        if compress is not None:
            kwargs["compress"] = compress
        if self.args.min_tensor_bytes is not None:
            kwargs["min_tensor_bytes"] = self.args.min_tensor_bytes
        offloader = self.offload.ActivationOffloader(self.layers, **kwargs)

        def offloaded(x: torch.Tensor) -> torch.Tensor:
            with offloader:
                return self.forward(x)

        return offloaded, offloader

    def step(self, loss: Callable[[torch.Tensor], torch.Tensor]) -> float:
        """One step's device ms (host ms on the CPU)."""
        self.layers.zero_grad(set_to_none=True)
        x = self.new_input()
        self.sync()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss(x).backward()
            end.record()
            self.sync()
            return float(start.elapsed_time(end))
        begin = time.perf_counter()
        loss(x).backward()
        return (time.perf_counter() - begin) * 1e3

    def peak(self, loss: Callable[[torch.Tensor], torch.Tensor]) -> int | None:
        """Activation peak of one step (gradients of the step before kept), bytes."""
        if not self.cuda:
            loss(self.new_input()).backward()
            return None
        x = self.new_input()
        self.sync()
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        loss(x).backward()
        self.sync()
        return int(torch.cuda.max_memory_allocated(self.device) - before)

    def measure(self, name: str) -> dict[str, Any]:
        """Warm-up, alternating blocks, peaks: one configuration (see the module doc)."""
        args, begin = self.args, time.perf_counter()
        none, _ = self.runner("none")
        loss, offloader = self.runner(name)
        for _ in range(args.warmup):
            self.step(none)
        warmup = 0
        while warmup < args.warmup or (
            offloader is not None and self.unsettled(offloader) and warmup < args.auto_warmup
        ):
            self.step(loss)
            warmup += 1
        times: dict[str, list[float]] = {"none": [], "config": []}
        for block in range(args.blocks if name != "none" else 1):
            order = ("none", "config") if block % 2 == 0 else ("config", "none")
            for which in order:
                fn = none if which == "none" else loss
                times[which] += [self.step(fn) for _ in range(args.steps)]
        if name == "none":
            times["config"] = times["none"]
        none_ms, config_ms = median(times["none"]), median(times["config"])
        out: dict[str, Any] = {
            "config": name,
            "warmup_steps": warmup,
            "none_ms": times["none"],
            "config_ms": times["config"],
            "none_ms_median": none_ms,
            "config_ms_median": config_ms,
            "ratio": config_ms / none_ms,
            "none_peak_bytes": self.peak(none),
            "peak_bytes": self.peak(loss),
        }
        if offloader is not None:
            stats = offloader.stats
            out["bytes_offloaded"] = stats.bytes_offloaded
            out["layers_offloaded"] = sum(1 for la in stats.layers if la.offloaded)
            if stats.auto is not None:
                auto = stats.auto
                out["auto"] = {k: auto[k] for k in ("phase", "step", "chosen") if k in auto}
            offloader.close()
        del loss, offloader
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
        out["wall_s"] = time.perf_counter() - begin
        return out

    @staticmethod
    def unsettled(offloader: Any) -> bool:
        """``offload_layers="auto"`` still measuring or verifying (trees that report a
        phase); False for every other offloader."""
        auto = offloader.stats.auto
        return auto is not None and auto.get("phase") not in (None, "settled")


def run_worker(args: argparse.Namespace) -> None:
    worker = Worker(args)
    if not worker.cuda:
        torch.set_num_threads(1)  # tiny ops: as bench_activations.py --quick
    results = [worker.measure(name) for name in args.configs.split(",")]
    out = {"offload_file": str(worker.offload_file), "configs": results}
    print(RESULT + json.dumps(out), flush=True)


# --------------------------------------------------------------------------------------
# driver: both trees, interleaved


def tree_env(tree: Path) -> dict[str, str]:
    """The environment of a child process that imports ``offload`` from ``tree``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(ROOT)])
    return env


def sizes_of(preset: str, quick: bool) -> dict[str, int]:
    """The model sizes of a preset (``bench_activations.py``'s), or their quick form."""
    import dataclasses

    from benchmarks.activations.bench_activations import PRESETS, QUICK

    if not quick:
        return dataclasses.asdict(PRESETS[preset][0])
    layers = {"ref-8L": QUICK.layers, "tiny48": 6}[preset]
    return dataclasses.asdict(dataclasses.replace(QUICK, layers=layers))


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def call_worker(
    tree: Path, preset: str, configs: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    """One worker process: its result, or ``{"error": ...}``."""
    cmd = [sys.executable, str(HERE), "--worker", "--tree", str(tree), "--device", args.device]
    cmd += ["--sizes", json.dumps(sizes_of(preset, args.quick)), "--configs", ",".join(configs)]
    cmd += ["--steps", str(args.steps), "--blocks", str(args.blocks)]
    cmd += ["--warmup", str(args.warmup), "--auto-warmup", str(args.auto_warmup)]
    if args.quick:
        cmd += ["--min-tensor-bytes", "0"]
    begin = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, env=tree_env(tree), capture_output=True, text=True, timeout=args.timeout
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s", "wall_s": args.timeout}
    wall = time.perf_counter() - begin
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return {**json.loads(line[len(RESULT) :]), "wall_s": wall}
    return {"error": f"exit {proc.returncode}: {_tail(proc.stderr or proc.stdout)}", "wall_s": wall}


def call_hooks(tree: Path, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """``bench_hooks.py`` of this checkout against ``tree``'s package: per device, the
    model rows' us per saved tensor and the direct rows' us per tensor."""
    out = scratch / "hooks.json"
    cmd = [sys.executable, str(HOOKS), "--devices", args.device, "--out", str(out)]
    cmd += QUICK_HOOKS_ARGS if args.quick else HOOKS_ARGS
    begin = time.perf_counter()
    proc = subprocess.run(cmd, env=tree_env(tree), capture_output=True, text=True)
    wall = time.perf_counter() - begin
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {_tail(proc.stderr)}", "wall_s": wall}
    data = json.loads(out.read_text())
    if tree not in Path(data["offload_file"]).resolve().parents:
        return {"error": f"bench_hooks imported {data['offload_file']}, not {tree}"}
    rows: dict[str, float] = {}
    for dev, res in data["devices"].items():
        for row in res["model"]["rows"]:
            if "bytes_offloaded" not in row:  # not one of the offloader's rows
                continue
            rows[f"{dev} model {row['name']}: us/saved vs identity"] = row[
                "us_per_saved_vs_identity"
            ]
        for row in res["direct"]:
            for col in ("pack", "unpack", "free", "groups", "total"):
                rows[f"{dev} direct {row['path']}: {col}"] = row["us_per_tensor"][col]
    return {"rows": rows, "wall_s": wall, "raw": data["devices"]}


def summarize(result: dict[str, Any], tolerance: float) -> dict[str, Any]:
    """Per configuration and per ``bench_hooks`` row: old, new, new/old, verdict."""

    def verdict(rel: float) -> str:
        return "ok" if abs(rel - 1) <= tolerance else ("slower" if rel > 1 else "faster")

    configs = []
    for preset, names in result["settings"]["configs"].items():
        for name in names:
            per: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
            for run in result["runs"]:
                if run["preset"] == preset:
                    per[run["tree"]] += [c for c in run.get("configs", []) if c["config"] == name]
            row: dict[str, Any] = {"preset": preset, "config": name}
            if not per["old"] or not per["new"]:
                configs.append(row | {"verdict": "missing"})
                continue
            for which, found in per.items():
                row[f"{which}_ratio"] = median([c["ratio"] for c in found])
                row[f"{which}_ms"] = median([c["config_ms_median"] for c in found])
                row[f"{which}_none_ms"] = median([c["none_ms_median"] for c in found])
                row[f"{which}_peaks"] = [c["peak_bytes"] for c in found]
                row[f"{which}_layers_offloaded"] = [c.get("layers_offloaded") for c in found]
            row["new_over_old"] = row["new_ratio"] / row["old_ratio"]
            peaks = set(row["old_peaks"] + row["new_peaks"])
            row["peaks_equal"] = None if None in peaks else len(peaks) == 1
            row["verdict"] = verdict(row["new_over_old"])
            configs.append(row)
    hooks = []
    runs = {
        w: [r["rows"] for r in result["hooks_runs"] if r["tree"] == w and "rows" in r]
        for w in ("old", "new")
    }
    if runs["old"] and runs["new"]:
        for key in runs["new"][0]:
            if not all(key in r for r in runs["old"]):
                continue
            old = median([r[key] for r in runs["old"]])
            new = median([r[key] for r in runs["new"]])
            rel = new / old if old > 0 else float("nan")
            hooks.append(
                {
                    "row": key,
                    "old_us": old,
                    "new_us": new,
                    "new_over_old": rel,
                    "verdict": verdict(rel) if old > 0 else "n/a",
                }
            )
    return {"configs": configs, "hooks": hooks}


def print_report(result: dict[str, Any]) -> None:
    summary, s = result["summary"], result["settings"]
    print(
        f"bench_versions: old {s['old']} vs new {s['new']} on {s['device']}, {s['rounds']} "
        f"rounds; ratio = config / no offload in the same process (median over rounds)"
    )
    head = f"{'preset':8} {'config':11} {'old x':>7} {'new x':>7} {'new/old':>8} "
    print(head + f"{'old ms':>8} {'new ms':>8} {'peak old':>13} {'peak new':>13} peaks  verdict")
    for r in summary["configs"]:
        if r["verdict"] == "missing":
            print(f"{r['preset']:8} {r['config']:11} missing (see errors in the JSON)")
            continue
        peak_old, peak_new = r["old_peaks"][0], r["new_peaks"][0]
        equal = {None: "n/a", True: "equal", False: "DIFFER"}[r["peaks_equal"]]
        print(
            f"{r['preset']:8} {r['config']:11} {r['old_ratio']:7.3f} {r['new_ratio']:7.3f} "
            f"{r['new_over_old']:8.3f} {r['old_ms']:8.1f} {r['new_ms']:8.1f} "
            f"{peak_old if peak_old is not None else 'n/a':>13} "
            f"{peak_new if peak_new is not None else 'n/a':>13} {equal:6} {r['verdict']}"
        )
    if summary["hooks"]:
        print(f"bench_hooks (us per tensor, median of {s['hooks_rounds']} runs per tree):")
        for r in summary["hooks"]:
            print(
                f"  {r['row']:48} old {r['old_us']:7.2f}  new {r['new_us']:7.2f}  "
                f"new/old {r['new_over_old']:6.3f}  {r['verdict']}"
            )
    errors = [r for r in result["runs"] + result["hooks_runs"] if "error" in r]
    for r in errors:
        print(f"ERROR ({r['tree']}, {r.get('preset', 'bench_hooks')}): {r['error']}")
    print(f"total wall time {result['wall_s']:.0f} s")


def _reference_source(tree: Path) -> bytes:
    """The source of ``tree``'s reference model (``offload/models.py``, or the private
    ``offload/models.py`` of older trees)."""
    path = tree / "offload" / "models.py"
    return (path if path.exists() else tree / "offload" / "_reference.py").read_bytes()


def run_driver(args: argparse.Namespace) -> None:
    from benchmarks._common import environment, write_json

    begin = time.perf_counter()
    trees = {"old": Path(args.old).resolve(), "new": Path(args.new).resolve()}
    table = {p: names for p, names in args.configs.items() if names}
    references = [_reference_source(t) for t in trees.values()]
    result: dict[str, Any] = {
        "benchmark": "bench_versions",
        "command": [sys.executable, *sys.argv],
        "settings": {k: v for k, v in vars(args).items() if k not in WORKER_ONLY}
        | {"configs": table},
        "trees": {k: str(v) for k, v in trees.items()},
        "reference_model_identical": references[0] == references[1],
        "environment": environment(torch.device(args.device)),
        "runs": [],
        "hooks_runs": [],
    }
    for r in range(args.rounds):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")
        for preset in table:
            configs = table[preset] if r % 2 == 0 else table[preset][::-1]
            for group in [[c] for c in configs] if args.per_config else [configs]:
                for which in order:
                    run = call_worker(trees[which], preset, group, args)
                    result["runs"].append({"round": r, "tree": which, "preset": preset, **run})
                    write_json(args.out, result)
                    print(f"round {r} {preset} {which} {','.join(group)}: {run['wall_s']:.0f} s")
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        for r in range(args.hooks_rounds):
            for which in ("old", "new") if r % 2 == 0 else ("new", "old"):
                run = call_hooks(trees[which], args, Path(scratch))
                result["hooks_runs"].append({"round": r, "tree": which, **run})
                write_json(args.out, result)
                print(f"bench_hooks round {r} {which}: {run['wall_s']:.0f} s")
    result["wall_s"] = time.perf_counter() - begin
    result["summary"] = summarize(result, args.tolerance)
    write_json(args.out, result)
    print_report(result)
    print(f"wrote {args.out}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--old", help="folder holding the old offload/ package")
    parser.add_argument("--new", help="folder holding the new offload/ package")
    parser.add_argument("--out", help="path of the JSON result")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (with --quick)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--presets", default="ref-8L,tiny48", help="comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="old/new process pairs")
    parser.add_argument("--per-config", action="store_true", help="a process per config")
    parser.add_argument("--configs", help="comma-separated subset of the presets' configurations")
    parser.add_argument("--steps", type=int, default=2, help="steps per block")
    parser.add_argument("--blocks", type=int, default=3, help="blocks each way per config")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps each way")
    parser.add_argument("--auto-warmup", type=int, default=30, help="most auto warm-up steps")
    parser.add_argument("--hooks-rounds", type=int, default=2, help="bench_hooks runs per tree")
    parser.add_argument("--tolerance", type=float, default=0.02, help="new/old within this")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per worker")
    worker = parser.add_argument_group("worker mode (started by the driver)")
    worker.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    worker.add_argument("--tree", help=argparse.SUPPRESS)
    worker.add_argument("--sizes", help=argparse.SUPPRESS)

    worker.add_argument("--min-tensor-bytes", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return args
    if not (args.old and args.new and args.out):
        parser.error("--old, --new and --out are required")
    for name in ("old", "new"):
        if not (Path(getattr(args, name)) / "offload" / "__init__.py").is_file():
            parser.error(f"--{name} {getattr(args, name)}: no offload/ package in it")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available here; use --quick --device cpu")
    if torch.device(args.device).type != "cuda" and not args.quick:
        parser.error(f"--device {args.device}: only with --quick (the ratios need a GPU)")
    args.presets = [p.strip() for p in args.presets.split(",") if p.strip()]
    unknown = [p for p in args.presets if p not in CONFIGS]
    if unknown or not args.presets:
        parser.error(f"--presets {unknown}: choose among {sorted(CONFIGS)}")
    table = QUICK_CONFIGS if args.quick else CONFIGS
    every = {c for p in args.presets for c in table[p]}
    chosen = None if args.configs is None else [c.strip() for c in args.configs.split(",")]
    if chosen is not None and (not chosen or not set(chosen) <= every):
        parser.error(f"--configs {args.configs}: choose among {sorted(every)}")
    args.configs = {p: [c for c in table[p] if chosen is None or c in chosen] for p in args.presets}
    if min(args.rounds, args.steps, args.blocks, args.warmup) < 1 or args.hooks_rounds < 0:
        parser.error("--rounds, --steps, --blocks and --warmup >= 1, --hooks-rounds >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
    else:
        run_driver(args)


if __name__ == "__main__":
    main()
