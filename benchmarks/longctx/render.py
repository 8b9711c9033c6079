"""The long-context tables of README.md and docs/long-context.md, from the benchmark's JSON.

Commands (from the repository root)::

    python3 benchmarks/longctx/render.py           # rewrite the tables in both files
    python3 benchmarks/longctx/render.py --check   # exit 1 where a table is out of date

Reads ``benchmarks/results/long_context.json`` (written by ``bench_long_context.py``,
its parts collected with ``--append``); a method's longest length is the longest of its
rows that trained, and the next length tried says what stopped it. Each table sits between ``<!-- long_context:NAME -->`` and
``<!-- /long_context:NAME -->`` in the page: ``headline`` (README.md: per model, tokens/s
and activation peak at 16k and 32k tokens, the longest length) and ``full`` (the docs page:
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
    "ours-ckpt-head-liger": '**`offload_checkpointing` + `sliced_head_loss(backend="liger")`**',
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


def _label(
    method: str, row: dict[str, Any] | None = None, doc: dict[str, Any] | None = None
) -> str:
    """The method's name; ``(a)``, ``(b)``... after it where ``row`` was measured on
    another machine than the results file's main command (:func:`_mark`)."""
    mark = _mark(row, doc) if row is not None and doc is not None else ""
    return LABELS.get(method, method) + mark


def _main_commands(doc: dict[str, Any]) -> set[str]:
    """The file's command and ``same_machine`` (commands run right after it on the
    machine it held): rows measured with one of these compare with each other."""
    return {" ".join(doc.get("command", [])), *doc.get("same_machine", [])}


def _others(doc: dict[str, Any]) -> list[str]:
    """The other calls' ``measured_with``, in the order their rows appear."""
    main = _main_commands(doc)
    found = (r.get("measured_with") for r in doc["rows"] if r.get("status") != "skipped")
    return list(dict.fromkeys(m for m in found if m and m not in main))


def _letter(index: int) -> str:
    return f"({chr(ord('a') + index)})"


def _mark(row: dict[str, Any], doc: dict[str, Any]) -> str:
    """`` (a)`` for the first other call's rows, `` (b)`` for the second's...; ``""``
    for rows of the main machine."""
    others = _others(doc)
    where = row.get("measured_with")
    return f" {_letter(others.index(where))}" if where in others else ""


#: The note under a table for a mark whose call the results file does not describe
#: (``apart_notes``: per ``measured_with``, what else differs, such as the tree it ran).
APART_NOTE = ("measured in a separate call, on another machine of the same kind: its step "
              "times compare exactly with the other rows of its mark only.")  # fmt: skip


def _apart_note(doc: dict[str, Any]) -> list[str]:
    others, notes = _others(doc), doc.get("apart_notes", {})
    if not others:
        return []
    return ["", *(f"{_letter(i)} {notes.get(m, APART_NOTE)}" for i, m in enumerate(others))]


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


def _longest(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (model, method): the longest length that trained (its row) and the outcome of
    the next length tried (``None`` where none longer was tried)."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for key in dict.fromkeys((r["model"], r["method"]) for r in rows):
        tried = sorted(
            (r for r in rows if (r["model"], r["method"]) == key), key=lambda r: r["seq"]
        )
        ok = [r for r in tried if r.get("status") == "ok"]
        best = ok[-1] if ok else None
        after = [r for r in tried if best is None or r["seq"] > best["seq"]]
        out[key] = {"best": best, "next": after[0] if after else None}
    return out


def _stopped(entry: dict[str, Any]) -> str:
    nxt = entry["next"]
    if nxt is None:
        best = entry["best"]
        return f"not tried past {best['seq']:,}" if best else "-"
    status = {"oom": "device OOM", "killed": "host memory (killed)"}.get(
        nxt["status"], nxt["status"]
    )
    return f"{status} at {nxt['seq']:,}"


def _rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in doc["rows"] if r.get("status") != "skipped"]


def _longest_cell(entry: dict[str, Any]) -> str:
    """The longest length that trained; ``+`` where no longer one was tried."""
    best = entry["best"]
    if best is None:
        return "-"
    return f"{best['seq']:,}" + ("+" if entry["next"] is None else "")


def headline(doc: dict[str, Any]) -> str:
    """Per model: tokens/s and activation peak at each length measured, and the longest
    length that trained."""
    rows = _rows(doc)
    longest = _longest(rows)
    out = [f"Measured on one {_card(doc)}: tokens/s (higher is better) and activation "
           "peak in GiB (lower is better) per length; *longest*: the longest length that "
           "trained 3 steps, `+` where no longer one was tried. Batch 1, one process per "
           "configuration."]  # fmt: skip
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        seqs = sorted({r["seq"] for r in mine})
        head = ["method"] + [f"{s // 1024}k tok/s | {s // 1024}k GiB" for s in seqs] + ["longest"]
        out += ["", f"**{MODEL_LABELS.get(model, model)}**", "",
                "| " + " | ".join(head) + " |", "|---" * (2 + 2 * len(seqs)) + "|"]  # fmt: skip
        for method in dict.fromkeys(r["method"] for r in mine):
            at = {r["seq"]: r for r in mine if r["method"] == method}
            cells = [_label(method)]
            for s in seqs:
                row = at.get(s)
                mark = _mark(row, doc) if row is not None else ""
                cells += [_cell(row, "tokens_per_s", ".0f") + mark,
                          _cell(row, "activation_peak_gib", ".1f")]  # fmt: skip
            cells.append(_longest_cell(longest[(model, method)]))
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out + _apart_note(doc))


def full(doc: dict[str, Any]) -> str:
    """Every row: step time, tokens/s, its ratio to the fastest at that length, peaks;
    then each method's longest length and what stopped the next."""
    rows = _rows(doc)
    fastest: dict[tuple[str, int], float] = {}
    for r in rows:
        if r.get("status") == "ok":
            key = (r["model"], r["seq"])
            fastest[key] = max(fastest.get(key, 0.0), r["tokens_per_s"])
    out = [f"Measured on one {_card(doc)}.", "",
           "| model | seq | method | step ms | tokens/s | vs fastest | activation peak GiB | host peak GiB |",
           "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in sorted(rows, key=lambda r: (r["model"], r["seq"])):
        ok = r.get("status") == "ok"
        ratio = r["tokens_per_s"] / fastest[(r["model"], r["seq"])] if ok else None
        out.append(
            f"| {r['model']} | {r['seq']} | {_label(r['method'], r, doc)} | {_cell(r, 'step_ms', '.0f')} "
            f"| {_cell(r, 'tokens_per_s', '.0f')} | {'-' if ratio is None else format(ratio, '.2f')} "
            f"| {_cell(r, 'activation_peak_gib', '.2f')} | {_cell(r, 'host_peak_gib', '.1f')} |"
        )
    out += _apart_note(doc)
    skipped = [r for r in doc["rows"] if r.get("status") == "skipped"]
    if skipped:
        reasons = sorted({f"{r['method']} ({r.get('reason', '')})" for r in skipped})
        out += ["", "Not run: " + "; ".join(reasons) + "."]
    out += ["", "| model | method | longest trained | tokens/s there | next length |",
            "|---|---|---|---|---|"]  # fmt: skip
    for (model, method), entry in _longest(rows).items():
        best = entry["best"]
        seq = _longest_cell(entry)
        out.append(
            f"| {model} | {_label(method)} | {seq} "
            f"| {_cell(best, 'tokens_per_s', '.0f')} | {_stopped(entry)} |"
        )
    return "\n".join(out)


def render() -> dict[str, str]:
    """``{table name: markdown}``; empty where the results file does not exist yet."""
    doc = _load("long_context")
    if doc is None:
        return {}
    return {"headline": headline(doc), "full": full(doc)}


def _marked(name: str) -> re.Pattern[str]:
    return re.compile(rf"<!-- long_context:{name} -->\n(.*?)\n?<!-- /long_context:{name} -->", re.S)


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
        if match.group(1) != text:
            stale.append(str(page.relative_to(ROOT)))
            if not args.check:
                block = f"<!-- long_context:{name} -->\n{text}\n<!-- /long_context:{name} -->"
                page.write_text(source[: match.start()] + block + source[match.end() :])
    if args.check and stale:
        print("out of date (run python3 benchmarks/longctx/render.py):", ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
