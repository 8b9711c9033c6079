"""The long-context tables of README.md and docs/long-context.md, from the benchmark's JSON.

Commands (from the repository root)::

    python3 benchmarks/longctx/render.py           # rewrite the tables in both files
    python3 benchmarks/longctx/render.py --check   # exit 1 where a table is out of date

Reads ``benchmarks/results/long_context.json`` (rows at fixed lengths) and
``benchmarks/results/long_context_longest.json`` (``--longest``), both written by
``bench_long_context.py``. Each table sits between ``<!-- long_context:NAME -->`` and
``<!-- /long_context:NAME -->`` in the page: ``headline`` (README.md: per model, tokens/s
and activation peak at each length, the longest sequence) and ``full`` (the docs page:
every row with step time, the ratio to the fastest method at each length, host memory
and status).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
PAGES = {"headline": ROOT / "README.md", "full": ROOT / "docs" / "long-context.md"}

#: How each method is named in the tables (ours in bold).
LABELS = {
    "none": "no offloading",
    "hf-ckpt": "HF checkpointing",
    "hf-ckpt-offload": "HF checkpointing, `offload=True`",
    "ours-default": "**`ActivationOffloader`, default**",
    "ours-ckpt": "**`offload_checkpointing`**",
    "ours-ckpt-head": "**`offload_checkpointing` + `sliced_head_loss`**",
    "ours-ckpt-head-tile": "**`offload_checkpointing` + `sliced_head_loss` + `tile_mlp`**",
    "ours-plan": "**`offload.plan`**",
    "trl-offload": "TRL activation offloading",
    "trl-offload-ckpt": "TRL activation offloading + HF checkpointing",
    "deepspeed-ckpt-offload": "DeepSpeed `CheckpointHiddenStatesOffload` + HF checkpointing",
    "deepspeed-ckpt-offload-tiled": "DeepSpeed hidden-state offload + its tiled loss and MLP",
    "unsloth-zoo": "unsloth_zoo offloaded checkpointing + fused loss",
    "unsloth-zoo-nofused": "unsloth_zoo offloaded checkpointing",
}
MODEL_LABELS = {
    "llama-8b-lora": "Llama-3-8B shape, LoRA r=16",
    "llama-1b": "Llama ~1.1B, full fine-tune",
}


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _label(method: str) -> str:
    return LABELS.get(method, method)


def _cell(row: dict[str, Any] | None, key: str, spec: str) -> str:
    if row is None:
        return "-"
    if row.get("status") != "ok":
        return {"oom": "OOM", "killed": "host OOM"}.get(
            row.get("status", ""), row.get("status", "-")
        )
    value = row.get(key)
    return "-" if value is None else format(value, spec)


def _card(doc: dict[str, Any]) -> str:
    env = doc.get("environment", {})
    return str(env.get("gpu") or env.get("device") or "unknown device")


def headline(fixed: dict[str, Any], longest: dict[str, Any] | None) -> str:
    """Per model: tokens/s and activation peak at each length, and the longest sequence."""
    rows = fixed["rows"]
    seqs = sorted({r["seq"] for r in rows})
    best = {(r["model"], r["method"]): r for r in (longest or {}).get("rows", [])}
    out = [f"Measured on one {_card(fixed)}; tokens/s (higher is better) and activation "
           "peak in GiB (lower is better), one process per configuration."]  # fmt: skip
    for model in dict.fromkeys(r["model"] for r in rows):
        head = ["method"] + [f"{s // 1024}k tok/s | {s // 1024}k GiB" for s in seqs]
        if best:
            head.append("longest")
        out += ["", f"**{MODEL_LABELS.get(model, model)}**", "",
                "| " + " | ".join(head) + " |",
                "|---" * (1 + 2 * len(seqs) + bool(best)) + "|"]  # fmt: skip
        for method in dict.fromkeys(r["method"] for r in rows if r["model"] == model):
            at = {r["seq"]: r for r in rows if r["model"] == model and r["method"] == method}
            if all(at.get(s, {}).get("status") == "skipped" for s in seqs):
                continue
            cells = [_label(method)]
            for s in seqs:
                cells += [_cell(at.get(s), "tokens_per_s", ".0f"),
                          _cell(at.get(s), "activation_peak_gib", ".1f")]  # fmt: skip
            if best:
                b = best.get((model, method))
                cells.append("-" if not b or not b.get("longest_seq") else f"{b['longest_seq']:,}")
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def full(fixed: dict[str, Any], longest: dict[str, Any] | None) -> str:
    """Every row: step time, tokens/s, its ratio to the fastest at that length, peaks."""
    rows = fixed["rows"]
    fastest: dict[tuple[str, int], float] = {}
    for r in rows:
        if r.get("status") == "ok":
            key = (r["model"], r["seq"])
            fastest[key] = max(fastest.get(key, 0.0), r["tokens_per_s"])
    out = [f"Measured on one {_card(fixed)} (`{' '.join(fixed.get('command', [])[1:])}`).", "",
           "| model | seq | method | step ms | tokens/s | vs fastest | activation peak GiB | host peak GiB |",
           "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if r.get("status") == "skipped":
            continue
        ok = r.get("status") == "ok"
        ratio = r["tokens_per_s"] / fastest[(r["model"], r["seq"])] if ok else None
        out.append(
            f"| {r['model']} | {r['seq']} | {_label(r['method'])} | {_cell(r, 'step_ms', '.0f')} "
            f"| {_cell(r, 'tokens_per_s', '.0f')} | {'-' if ratio is None else format(ratio, '.2f')} "
            f"| {_cell(r, 'activation_peak_gib', '.2f')} | {_cell(r, 'host_peak_gib', '.1f')} |"
        )
    skipped = [r for r in rows if r.get("status") == "skipped"]
    if skipped:
        out += ["", "Not run: " + "; ".join(
            sorted({f"{r['method']} ({r.get('reason', '')})" for r in skipped}))]  # fmt: skip
    if longest:
        out += ["", f"The longest sequence that trains 3 steps (doubling from 16k; one "
                f"{_card(longest)}):", "",
                "| model | method | longest | tokens/s there | activation peak GiB | host peak GiB | stopped by |",
                "|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in longest["rows"]:
            longest_seq = r.get("longest_seq")
            stop = r.get("stopped_by") or "-"
            if stop == "killed":
                stop = "host memory (process killed)"
            out.append(
                f"| {r['model']} | {_label(r['method'])} | {'-' if not longest_seq else f'{longest_seq:,}'} "
                f"| {'-' if r.get('tokens_per_s_at_longest') is None else format(r['tokens_per_s_at_longest'], '.0f')} "
                f"| {'-' if r.get('activation_peak_gib_at_longest') is None else format(r['activation_peak_gib_at_longest'], '.2f')} "
                f"| {'-' if r.get('host_peak_gib_at_longest') is None else format(r['host_peak_gib_at_longest'], '.1f')} "
                f"| {stop} |"
            )
    return "\n".join(out)


def render() -> dict[str, str]:
    """``{table name: markdown}``; empty where the results file does not exist yet."""
    fixed, longest = _load("long_context"), _load("long_context_longest")
    if fixed is None:
        return {}
    return {"headline": headline(fixed, longest), "full": full(fixed, longest)}


def _marked(name: str) -> re.Pattern[str]:
    return re.compile(
        rf"(<!-- long_context:{name} -->\n)(.*?)(\n<!-- /long_context:{name} -->)", re.S
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 where a table is out of date")
    args = p.parse_args(argv)
    stale = []
    for name, text in render().items():
        page = PAGES[name]
        source = page.read_text()
        match = _marked(name).search(source)
        if match is None:
            raise SystemExit(f"{page}: no <!-- long_context:{name} --> markers")
        if match.group(2) != text:
            stale.append(str(page.relative_to(ROOT)))
            if not args.check:
                page.write_text(source[: match.start(2)] + text + source[match.end(2) :])
    if args.check and stale:
        print("out of date (run python3 benchmarks/longctx/render.py):", ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
