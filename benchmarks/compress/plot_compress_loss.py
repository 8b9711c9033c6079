"""Plot the char-GPT loss curves of bench_compress_accuracy.py: uncompressed offloading
against ``compress="fp8"``, same seed and batches.

Command (any machine with matplotlib: ``pip install "offload[plot]"``)::

    PYTHONPATH=. python3 benchmarks/compress/plot_compress_loss.py \\
        --json benchmarks/results/compress_accuracy.json --png docs/compress_loss.png

Reads ``gpt`` of the JSON that ``benchmarks/compress/bench_compress_accuracy.py --out`` wrote (run
it with ``--parts gpt`` or the default ``ref,gpt``) and draws, with matplotlib's Agg
backend (no display needed):

* x axis: optimizer updates done; the training loss of step i (on the weights after i
  updates) is at x = i, the validation loss after s updates at x = s.
* Top panel: training loss of every step (cross-entropy in nats per byte) of the
  ``uncompressed`` (``compress=None``) and ``compressed`` (``compress="fp8"``) runs, as
  lines, and their validation losses (at step 0 and every ``val_every`` steps) as
  markers. The ``control`` run (uncompressed again) is not drawn: the legend says
  whether it was bitwise identical to ``uncompressed``.
* Bottom panel: ``(compressed - uncompressed) / uncompressed`` of the training loss per
  step (thin) and its mean over the trailing 20 steps (thick), in percent, with the
  +-1 % band of the benchmark's verdict dashed, and the same for the validation points.
* Title: the GPU name from the JSON's ``environment`` (the device when there was no
  GPU), the model, the final-loss differences (mean of the last 20 training losses;
  last validation loss) and, when the stats report them, ``compress_bytes_after /
  compress_bytes_before`` of the last step (what the compressed tensors shrank to).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

WINDOW = 20  # steps of the trailing mean in the bottom panel
COLORS = {"uncompressed": "tab:blue", "compressed": "tab:orange"}


def trailing_mean(values: Sequence[float], window: int) -> list[float]:
    """Mean of each value and the ``window - 1`` before it (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def title_of(result: dict[str, Any]) -> str:
    """Two lines: where and what; the final differences."""
    env, gpt = result["environment"], result["gpt"]
    where = env.get("gpu") or env.get("device", "?")
    m = gpt["model"]
    compress = gpt["runs"]["compressed"]["compress"]
    fp32 = " (fp32 exact)" if result["settings"].get("keep_fp32") else ""
    line1 = (
        f"{where}: char-GPT {m['layers']}L d{m['d_model']} ctx {m['context']} batch "
        f"{m['batch']}, {m['steps']} steps, offload_layers='all', compress={compress!r}{fp32}"
    )
    line2 = (
        f"final train loss {gpt['final_train_rel_diff']:+.2%}, final val loss "
        f"{gpt['final_val_rel_diff']:+.2%} vs uncompressed"
    )
    ratio = compression_ratio(gpt["runs"]["compressed"])
    if ratio is not None:
        line2 += f"; compressed tensors: {ratio:.2f}x their bytes"
    return f"{line1}\n{line2}"


def compression_ratio(run: dict[str, Any]) -> float | None:
    """``compress_bytes_after / compress_bytes_before`` of the run's stats, if reported."""
    fields = run.get("compression_fields") or {}
    before, after = fields.get("compress_bytes_before"), fields.get("compress_bytes_after")
    if isinstance(before, int | float) and isinstance(after, int | float) and before:
        return after / before
    return None


def draw(result: dict[str, Any], png: Path) -> None:
    """Write the two-panel figure of ``result`` to ``png``."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    gpt = result["gpt"]
    runs = gpt["runs"]
    fig = Figure(figsize=(10, 7), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 1.3))
    for name in ("uncompressed", "compressed"):
        run = runs[name]
        steps = range(len(run["train_loss"]))  # updates made before the loss
        label = f"{name} (compress={run['compress']!r})"
        top.plot(steps, run["train_loss"], color=COLORS[name], lw=0.8, alpha=0.8, label=label)
        val_steps, val_losses = zip(*run["val"], strict=True)
        top.plot(
            val_steps,
            val_losses,
            ls="none",
            marker="o" if name == "uncompressed" else "x",
            ms=6,
            color=COLORS[name],
            label=f"{name}: validation",
        )
    control = gpt.get("control_bitwise_identical")
    if control is not None:
        top.plot(
            [], [], ls="none", label=f"control bitwise identical: {'yes' if control else 'no'}"
        )
    top.set_ylabel("loss (nats / byte)")
    top.legend(loc="upper right", fontsize=8)
    top.grid(alpha=0.3)

    base, comp = runs["uncompressed"]["train_loss"], runs["compressed"]["train_loss"]
    rel = [100 * (c - b) / b for b, c in zip(base, comp, strict=True)]
    steps = range(len(rel))
    bottom.plot(steps, rel, color=COLORS["compressed"], lw=0.5, alpha=0.4, label="per step")
    bottom.plot(
        steps,
        trailing_mean(rel, WINDOW),
        color=COLORS["compressed"],
        lw=1.8,
        label=f"trailing mean of {WINDOW}",
    )
    val_rel = [
        (s, 100 * (c - b) / b)
        for (s, b), (_, c) in zip(
            runs["uncompressed"]["val"], runs["compressed"]["val"], strict=True
        )
    ]
    bottom.plot(*zip(*val_rel, strict=True), ls="none", marker="x", color="k", label="validation")
    for level in (-1, 1):
        bottom.axhline(level, color="gray", ls="--", lw=0.8)
    bottom.axhline(0, color="gray", lw=0.5)
    bottom.set_ylabel("compressed vs\nuncompressed (%)")
    bottom.set_xlabel("optimizer steps done (training loss of step i: after i updates)")
    bottom.legend(loc="upper right", fontsize=8, ncols=3)
    bottom.grid(alpha=0.3)
    fig.suptitle(title_of(result), fontsize=10)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="output of bench_compress_accuracy.py")
    parser.add_argument("--png", required=True, help="image to write")
    args = parser.parse_args(argv)
    result = json.loads(Path(args.json).read_text())
    if "gpt" not in result:
        parser.error(f"{args.json} has no 'gpt' part (run the benchmark with --parts gpt)")
    draw(result, Path(args.png))
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
