"""``offload_layers="auto"`` against no offloading, in alternating blocks, and against the
best fixed k within 1.03x measured in the same run.

Command (one CUDA GPU; about five minutes on an H200, of which about four and a half of
GPU time)::

    PYTHONPATH=. python3 benchmarks/activations/bench_auto.py --out benchmarks/results/auto.json
    PYTHONPATH=. python3 benchmarks/activations/bench_auto.py --quick --device cpu --out /tmp/a.json

Models (bf16, forward + backward, no optimizer step; gradients set to ``None`` before each
step, as an optimizer's ``zero_grad`` does):

* ``ref-8L``: 8 Llama-style layers (``offload.models``), hidden 4096, 32 heads, ffn
  14336, seq 4096, batch 1; loss = mean of squares of the output.
* ``tiny48``: 48 of those layers with hidden 256, 4 heads, ffn 704, seq 256, batch 4
  (launch-bound: the host sets the pace).
* ``hf-llama-1b seq N``: a Hugging Face Llama built from a config with random weights
  (hidden 2048, 16 layers, 32 heads, 4 KV heads, ffn 5632, vocab 32000, SDPA), batch 1,
  seq 4096, 8192 and 16384; loss = the model's causal LM loss; layers =
  ``find_layers(model)``.

Each of ``--runs`` runs does, per model:

1. ``auto``: a fresh ``ActivationOffloader(layers)`` (the default, ``"auto"``) runs until
   its ``stats.auto["phase"]`` is ``"settled"`` (at most ``--settle`` steps): its measuring
   forward, its own verification against steps without offloading and any back-off.
2. A/B: one unmeasured step of each, then ``--rounds`` rounds of two blocks of
   ``--steps`` steps, no offloading and ``auto``, the first of each round alternating
   (ABBA...). ``ratio`` = the median over rounds of (auto's median step in the round /
   no offloading's): adjacent blocks share the speed of the moment, which drifts within
   a run (host-paced models most). ``ratio_of_medians`` beside it. Auto's own kind of
   each timed step (``plan``, ``verify`` when it verified again without offloading,
   ``probe``) is recorded with it; its ``verify`` steps are left out of the ratios.
3. Fixed k: the largest k whose A/B ratio (``--k-rounds`` rounds, same blocks) is at most
   1.03, by bisection over 1..L-1 with one offloader whose selection is a mutable k (one
   host pool). Its activation memory is measured the same way.

Memory: ``act GiB`` = the peak allocated during a step minus allocated before it
(``reset_peak_memory_stats`` before each timed step); ``saved`` = no offloading's act
minus the row's. Per run and model the JSON holds the ratio, auto's layers and saved
bytes, the best fixed k within 1.03x and its saved bytes, and ``share`` = auto's saved /
the best fixed k's (targets: ratio <= 1.03 in every run, share >= 0.9).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch


def _repo_root() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    while not os.path.isdir(os.path.join(here, "offload")) and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    return here


sys.path.insert(0, _repo_root())

import offload  # noqa: E402
from benchmarks._common import llama_1b_config  # noqa: E402
from offload.models import ReferenceModel  # noqa: E402

LIMIT = 1.03
GIB = 1024**3


# ---- models ----------------------------------------------------------------------------


def ref_model(args, device, dtype, name: str):
    sizes = {
        "ref-8L": ((8, 4096, 32, 14336), (1, 4096)),
        "tiny48": ((48, 256, 4, 704), (4, 256)),
    }[name]
    (n, hidden, heads, ffn), (batch, seq) = sizes
    if args.quick:
        n, hidden, heads, ffn, batch, seq = min(n, 6), 64, 4, 128, 1, 32
    torch.manual_seed(0)
    model = ReferenceModel(n, hidden, heads, ffn, device=device, dtype=dtype)
    gen = torch.Generator(device).manual_seed(0)
    x = torch.randn(batch, seq, hidden, device=device, dtype=dtype, generator=gen)
    return model, list(model.layers), {name: lambda: model.loss(x)}


def hf_model(args, device, dtype, seqs: list[int]):
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.quick:
        cfg = LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
        )
        seqs = [32]
    else:
        cfg = llama_1b_config(max(seqs))
    cfg.use_cache = False
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs (fast for 1.1B parameters)
        model = LlamaForCausalLM(cfg).to(dtype=dtype)
    model.train()
    gen = torch.Generator(device).manual_seed(0)
    losses: dict[str, Callable[[], torch.Tensor]] = {}
    for seq in seqs:
        ids = torch.randint(0, cfg.vocab_size, (1, seq), device=device, generator=gen)
        name = f"hf-llama-1b seq {seq}" if not args.quick else "hf-llama (quick)"
        losses[name] = lambda ids=ids: model(input_ids=ids, labels=ids).loss
    return model, offload.find_layers(model), losses


# ---- measuring -------------------------------------------------------------------------


class Runner:
    """Runs and times steps of one model on one device."""

    def __init__(self, model, loss_fn, device: torch.device) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.loss_fn = loss_fn
        self.cuda = device.type == "cuda"
        self.device = device

    def step(self, off: Any = None) -> tuple[float, float | None]:
        """One forward + backward: device ms and act GiB."""
        for p in self.params:
            p.grad = None
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        with off if off is not None else contextlib.nullcontext():
            loss = self.loss_fn()
        loss.backward()
        del loss
        if self.cuda:
            end.record()
            end.synchronize()
            act = (torch.cuda.max_memory_allocated(self.device) - before) / GIB
            return start.elapsed_time(end), act
        return (time.perf_counter() - t0) * 1e3, None

    def ab(self, off: Any, rounds: int, steps: int, watch: Any = None) -> dict[str, Any]:
        """No offloading and ``off`` in alternating blocks of ``steps`` steps (ABBA...),
        after one unmeasured step of each. ``ratio``: the median over rounds of the
        round's ratio (its median ``off`` step over its median step without offloading):
        blocks next to each other in time share the host's and the device's speed of
        the moment, which drift between machine starts and within a run."""
        times: dict[str, list[tuple[float, float | None]]] = {"none": [], "off": []}
        kinds: list[str] = []
        paired: list[float] = []
        self.step(None)
        self.step(off)
        for r in range(rounds):
            order = [("none", None), ("off", off)]
            got: dict[str, list[float]] = {"none": [], "off": []}
            for name, o in order if r % 2 == 0 else order[::-1]:
                for _ in range(steps):
                    ms, act = self.step(o)
                    times[name].append((ms, act))
                    kind = watch() if name == "off" and watch is not None else "plan"
                    if name == "off":
                        kinds.append(kind)
                    if kind != "verify":  # auto's own steps without offloading aside
                        got[name].append(ms)
            if got["off"]:
                paired.append(statistics.median(got["off"]) / statistics.median(got["none"]))
        none_ms = statistics.median(t for t, _ in times["none"])
        off_ms = statistics.median(t for t, _ in times["off"])
        acts = {k: [a for _, a in v if a is not None] for k, v in times.items()}
        # auto's own verifying steps without offloading (started again when it saw its
        # ratio drift) aside: what its choice costs and saves
        chosen = [x for x, kind in zip(times["off"], kinds) if kind != "verify"]
        chosen_acts = [a for _, a in chosen if a is not None]
        return {
            "ratio": statistics.median(paired) if paired else None,
            "ratio_of_medians": (
                statistics.median(t for t, _ in chosen) / none_ms if chosen else None
            ),
            "ratio_all": off_ms / none_ms,
            "none_ms": [t for t, _ in times["none"]],
            "off_ms": [t for t, _ in times["off"]],
            "none_act_gib": max(acts["none"]) if acts["none"] else None,
            "off_act_gib": max(chosen_acts) if chosen_acts else None,
            "off_act_gib_all": max(acts["off"]) if acts["off"] else None,
            "auto_steps": kinds,
        }


def _kind(auto: dict[str, Any]) -> str:
    """What auto's step ran: ``verify`` (a step without offloading that verifies a
    choice), or its ``step`` (``plan``, ``probe``, ``none`` when nothing is chosen)."""
    if auto.get("step") == "none" and auto.get("chosen"):
        return "verify"
    return str(auto.get("step"))


def measure_auto(runner: Runner, layers, args) -> dict[str, Any]:
    off = offload.ActivationOffloader(layers)  # the default: offload_layers="auto"
    settle: list[dict[str, Any]] = []
    for i in range(args.settle):
        ms, _ = runner.step(off)
        a = off.stats.auto or {}
        settle.append(
            {
                "ms": ms,
                "step": a.get("step"),
                "phase": a.get("phase"),
                "offloaded": len(a.get("offloaded", [])),
                "measured_ratio": a.get("measured_ratio"),
            }
        )
        if a.get("phase") is None:
            break  # no accelerator: nothing to settle
        if (a.get("phase") == "settled" and a.get("step") == "plan") or (
            i >= 2 and a.get("step") == "none" and not a.get("chosen")
        ):
            break  # settled, or nothing to offload (the link hides no layer)
    ab = runner.ab(off, args.rounds, args.steps, watch=lambda: _kind(off.stats.auto or {}))
    auto = dict(off.stats.auto or {})
    off.close()
    return {
        "settle_steps": settle,
        "ab": ab,
        "k": len(auto.get("offloaded", [])),
        "reason": auto.get("reason"),
        "predicted_ratio": auto.get("predicted_ratio"),
        "measured_ratio_own": auto.get("measured_ratio"),
        "scale": auto.get("scale"),
        "memory_reason": auto.get("memory_reason"),
    }


def best_fixed_k(runner: Runner, fixed: Any, k_box: list[int], L: int, args) -> dict[str, Any]:
    """The largest k within LIMIT (bisection; the ratio grows with k)."""
    tried: dict[int, dict[str, Any]] = {}

    def trial(k: int) -> dict[str, Any]:
        k_box[0] = k
        got = runner.ab(fixed, args.k_rounds, args.steps)
        tried[k] = {
            "ratio": got["ratio"],
            "act_gib": got["off_act_gib"],
            "none_act_gib": got["none_act_gib"],
        }
        return tried[k]

    lo, hi = 0, L - 1  # lo: known within (0 trivially), hi: largest candidate
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if trial(mid)["ratio"] <= LIMIT:
            lo = mid
        else:
            hi = mid - 1
    return {"k": lo, "tried": {str(k): v for k, v in sorted(tried.items())}, **tried.get(lo, {})}


def _fmt(x: float | None, digits: int) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _write(
    args: argparse.Namespace,
    results: dict[str, list[dict[str, Any]]],
    device: Any,
    cuda: bool,
    started: float,
) -> dict[str, Any]:
    """The JSON so far (written after every run: a run cut short keeps what it measured)."""
    summary = {
        name: {
            "ratios": [r["ratio"] for r in rows],
            "shares": [r["share"] for r in rows],
            "ratio_ok": all(r["ratio"] is not None and r["ratio"] <= LIMIT for r in rows),
            "share_ok": all(r["share"] is not None and r["share"] >= 0.9 for r in rows),
        }
        for name, rows in results.items()
    }
    env = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device) if cuda else "cpu",
        "seconds": time.perf_counter() - started,
        "args": vars(args),
    }
    with open(args.out, "w") as f:
        json.dump({"env": env, "summary": summary, "results": results}, f, indent=1, default=str)
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=1, help="timed steps per block")
    p.add_argument("--rounds", type=int, default=21, help="A/B rounds, auto against none")
    p.add_argument("--k-rounds", type=int, default=9, help="A/B rounds per fixed k tried")
    p.add_argument("--settle", type=int, default=60, help="most steps for auto to settle")
    p.add_argument("--seqs", default="4096,8192,16384", help="HF Llama sequence lengths")
    p.add_argument("--models", default="ref-8L,tiny48,hf", help="ref-8L, tiny48, hf")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    started = time.perf_counter()
    cases = []  # (name, model, layers, loss_fn)
    wanted = args.models.split(",")
    for name in ("ref-8L", "tiny48"):
        if name in wanted:
            model, layers, losses = ref_model(args, device, dtype, name)
            cases += [(n, model, layers, fn) for n, fn in losses.items()]
    if "hf" in wanted:
        model, layers, losses = hf_model(
            args, device, dtype, [int(s) for s in args.seqs.split(",")]
        )
        cases += [(n, model, layers, fn) for n, fn in losses.items()]
    fixed_for: dict[int, tuple[Any, list[int]]] = {}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in cases}
    for run in range(args.runs):
        for name, model, layers, loss_fn in cases:
            runner = Runner(model, loss_fn, device)
            L = len(layers)
            if id(layers) not in fixed_for:  # one host pool per model, k set per trial
                k_box = [0]
                fixed = offload.ActivationOffloader(
                    layers, offload_layers=lambda i, m, b=k_box: i < b[0]
                )
                fixed_for[id(layers)] = (fixed, k_box)
            fixed, k_box = fixed_for[id(layers)]
            t0 = time.perf_counter()
            auto = measure_auto(runner, layers, args)
            best = best_fixed_k(runner, fixed, k_box, L, args)
            none_act = auto["ab"]["none_act_gib"]
            auto_saved = None if none_act is None else none_act - auto["ab"]["off_act_gib"]
            best_saved = None
            if none_act is not None and best.get("act_gib") is not None:
                best_saved = none_act - best["act_gib"]
            row = {
                "run": run,
                "layers": L,
                "ratio": auto["ab"]["ratio"],
                "ratio_all_steps": auto["ab"]["ratio_all"],
                "auto_k": auto["k"],
                "auto_saved_gib": auto_saved,
                "best_fixed_k": best["k"],
                "best_fixed_ratio": best.get("ratio"),
                "best_fixed_saved_gib": best_saved,
                "share": (auto_saved / best_saved)
                if best_saved
                else (1.0 if best["k"] == 0 else None),
                "auto": auto,
                "fixed": best,
                "seconds": time.perf_counter() - t0,
            }
            results[name].append(row)
            print(
                f"run {run} {name:>22}: auto {auto['k']:>2} layers, ratio {_fmt(row['ratio'], 3)}, "
                f"saved {_fmt(auto_saved, 2)} GiB; best fixed k={best['k']} saved "
                f"{_fmt(best_saved, 2)} GiB; share {_fmt(row['share'], 2)}",
                flush=True,
            )
        _write(args, results, device, cuda, started)
    for fixed, _ in fixed_for.values():
        fixed.close()
    summary = _write(args, results, device, cuda, started)
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
