"""A big model at long context: step time and activation peak against HF checkpointing.

A Llama-3-8B-shaped model from a config (hidden 4096, 32 layers, ffn 14336, 32 heads,
8 KV heads, vocab 128256, SDPA, random weights), bf16 base frozen, PEFT LoRA r=16 on
q/k/v/o, batch 1, loss from ``labels``; and HF Llama ~1.1B (``1b``: hidden 2048, 16
layers, full fine-tune). One process per configuration (``--cases``, each
``model:seq:method``; methods ``none``, ``hf-ckpt`` (non-reentrant), ``auto`` (the
offloader's default over ``find_layers``), ``all``). Per configuration: every step's
time and activation peak (the most allocated during the step above what was allocated
before it), the median step after 3 warm-up steps, out of memory recorded as such, the
offloader's summary; ``--history`` adds the live blocks at the step's peak by the frame
that allocated them (``torch.cuda.memory._record_memory_history``), and every run the
memory allocated at each layer boundary of its last step.

    PYTHONPATH=. python3 benchmarks/activations/bench_big_model.py \
        --out benchmarks/results/big_model_long_context.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

import offload

SHAPE = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    rope_theta=500000.0,
)


SHAPE_1B = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_attention_heads=32,
    num_key_value_heads=4,
    vocab_size=32000,
)


def build(layers: int, seq: int, model: str = "8b") -> torch.nn.Module:
    """``8b``: the 8B shape, bf16 frozen base with LoRA; ``1b``: HF Llama ~1.1B (16
    layers), bf16, full fine-tune."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **(SHAPE if model == "8b" else SHAPE_1B),
        num_hidden_layers=layers,
        max_position_embeddings=max(8192, seq),
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        net = LlamaForCausalLM(config).to(torch.bfloat16)
    if model == "1b":
        return net.train()
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    peft_model = get_peft_model(net, lora)
    peft_model.train()
    return peft_model


def _frame(frames: list[dict[str, Any]]) -> str:
    for f in frames:
        name = f.get("filename", "")
        for key in ("/offload/", "/transformers/", "/peft/", "torch/utils/checkpoint"):
            if key in name:
                return f"{name.split(key)[-1]}:{f.get('line')}:{f.get('name')}"
    for f in frames:
        name = f.get("filename", "")
        if name.endswith(".py"):
            return f"{name.rsplit('/', 2)[-1]}:{f.get('line')}:{f.get('name')}"
    return "?"


def live_at_peak(snapshot: dict[str, Any], base: int) -> dict[str, Any]:
    """Replay the allocation trace; the live blocks at the highest point, by frame."""
    trace = snapshot["device_traces"][0]
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for ev in trace:
        action, addr, size = ev["action"], ev["addr"], ev["size"]
        if action == "alloc":
            live[addr] = (size, _frame(ev.get("frames", [])))
            total += size
            if total > peak:
                peak = total
                at_peak = dict(live)
        elif action == "free_requested" and addr in live:
            total -= live.pop(addr)[0]
    by: dict[str, int] = defaultdict(int)
    for size, where in at_peak.values():
        by[where] += size
    top = sorted(by.items(), key=lambda kv: -kv[1])[:30]
    return {
        "peak_above_trace_start_gib": peak / 2**30,
        "blocks_at_peak": len(at_peak),
        "by_frame_gib": [(k, v / 2**30) for k, v in top],
    }


DEFAULT_CASES = (
    "8b:16384:hf-ckpt,8b:16384:auto:20,8b:16384:all,8b:32768:hf-ckpt,8b:32768:auto:20,"
    "1b:16384:none:14,1b:16384:auto:14"
)


def parent(args: argparse.Namespace) -> int:
    """Each case in a process of its own; one JSON and a table."""
    import os
    import subprocess
    import sys
    import tempfile

    from benchmarks._common import environment

    rows = []
    for case in args.cases.split(","):
        model, seq, method, *steps = case.split(":")
        layers = 32 if model == "8b" else 16
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "row.json")
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                "--model",
                model,
                "--method",
                method,
                "--layers",
                str(layers),
                "--seq",
                seq,
                "--steps",
                steps[0] if steps else "8",
                "--out",
                out,
            ]
            subprocess.run(cmd, check=False, timeout=args.timeout)
            row = json.load(open(out)) if os.path.exists(out) else {"case": case, "failed": True}
        row["case"] = case
        rows.append(row)
    result = {"environment": environment(torch.device("cuda")), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    base = {
        (r.get("model"), r.get("seq")): r for r in rows if r.get("method") in ("hf-ckpt", "none")
    }
    print(f"{'case':28} {'median ms':>10} {'vs base':>8} {'peak GiB':>9} {'steady':>7}  recomputed")
    for r in rows:
        b = base.get((r.get("model"), r.get("seq")), {})
        ratio = (
            r["median_ms"] / b["median_ms"] if r.get("median_ms") and b.get("median_ms") else None
        )
        steady = max((s["peak_gib"] for s in r.get("steps", [])[3:]), default=None)
        print(
            f"{r['case']:28} {r.get('median_ms', float('nan')):10.0f} "
            f"{'oom' if r.get('oom') else (f'{ratio:.3f}' if ratio else '-'):>8} "
            f"{r.get('peak_gib', float('nan')):9.2f} {steady if steady is None else round(steady, 2)!s:>7}  "
            f"{len(r.get('recomputed', []))}"
        )
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true", help="run one configuration (internal)")
    p.add_argument("--cases", default=DEFAULT_CASES)
    p.add_argument("--timeout", type=int, default=400)
    p.add_argument("--method", default="all", choices=["none", "all", "auto", "hf-ckpt"])
    p.add_argument("--model", default="8b", choices=["8b", "1b"])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--history", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if not args.worker:
        return parent(args)

    model = build(args.layers, args.seq, args.model)
    if args.method == "hf-ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    layers = offload.find_layers(model)
    off = None
    if args.method in ("all", "auto"):
        off = offload.ActivationOffloader(layers, offload_layers=args.method)
    marks: list[tuple[str, float]] = []

    def mark(tag: str) -> None:
        marks.append((tag, torch.cuda.memory_allocated() / 2**30))

    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: mark(f"f{i}<")))

        def post(m: Any, a: Any, out: Any, i: int = i) -> None:
            mark(f"f{i}>")
            t = out[0] if isinstance(out, tuple) else out
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda g, i=i: mark(f"b{i}"))

        hooks.append(layer.register_forward_hook(post))

    gen = torch.Generator().manual_seed(1)
    steps = []
    result: dict[str, Any] = {
        "model": args.model,
        "method": args.method,
        "layers": args.layers,
        "seq": args.seq,
        "device": torch.cuda.get_device_name(),
    }
    try:
        for s in range(args.steps):
            vocab = (SHAPE if args.model == "8b" else SHAPE_1B)["vocab_size"]
            ids = torch.randint(0, vocab, (1, args.seq), generator=gen).cuda()
            marks.clear()
            last = s == args.steps - 1
            torch.cuda.synchronize()
            if last and args.history:
                torch.cuda.memory._record_memory_history(max_entries=200000)
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            if off is not None:
                with off:
                    loss = model(input_ids=ids, labels=ids).loss
            else:
                loss = model(input_ids=ids, labels=ids).loss
            mark("loss")
            loss.backward()
            mark("end")
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            peak = torch.cuda.max_memory_allocated() - base
            steps.append({"ms": dt * 1e3, "peak_gib": peak / 2**30})
            if off is not None and off.stats.auto:
                steps[-1]["auto"] = {
                    k: off.stats.auto.get(k) for k in ("step", "offloaded", "recomputed")
                }
            print(
                f"step {s}: {dt * 1e3:.0f} ms, activation peak {peak / 2**30:.2f} GiB", flush=True
            )
            if last and args.history:
                snap = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                result["history"] = live_at_peak(snap, base)
            model.zero_grad(set_to_none=True)
    except torch.OutOfMemoryError as e:
        result["oom"] = str(e).splitlines()[0]
        print("OOM", result["oom"])
    result["steps"] = steps
    result["marks_gib"] = marks
    if steps:
        tail = steps[3:] or steps[1:] or steps  # after the warm-up
        result["median_ms"] = statistics.median(x["ms"] for x in tail)
        result["steps_run"] = len(steps)
        result["peak_gib"] = max(x["peak_gib"] for x in steps)
    if off is not None:
        st = off.stats
        result["offloaded_gib"] = st.bytes_offloaded / 2**30
        result["kept_gib"] = {k: v / 2**30 for k, v in st.bytes_kept.items() if v}
        result["summary"] = st.summary()
        result["recomputed"] = [la.index for la in st.layers if la.recomputed]
        result["auto"] = {k: v for k, v in (st.auto or {}).items() if k in ("reason", "phase")}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    brief = {k: v for k, v in result.items() if k not in ("marks_gib", "steps", "history")}
    print(json.dumps(brief)[:3000])
    print("marks:", " ".join(f"{t}={v:.1f}" for t, v in marks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
