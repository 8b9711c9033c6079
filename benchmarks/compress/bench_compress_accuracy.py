"""Accuracy cost of compressed activation offloading (``compress="fp8"``): gradients of
one ref-8L step, and the loss curves of a small char-level GPT trained 500 steps.

Command (one GPU; target: under three minutes on an H200)::

    PYTHONPATH=. python3 benchmarks/compress/bench_compress_accuracy.py --parts ref \\
        --out benchmarks/results/compress_accuracy_ref8l.json
    PYTHONPATH=. python3 benchmarks/compress/bench_compress_accuracy.py --compress-fp32 \\
        --out benchmarks/results/compress_accuracy.json
    PYTHONPATH=. python3 benchmarks/compress/plot_compress_loss.py \\
        --json benchmarks/results/compress_accuracy.json --png docs/compress_loss.png

CPU smoke run (tiny sizes, one CPU thread, about 20 s; the default device is cuda when
there is one, else cpu)::

    PYTHONPATH=. python3 benchmarks/compress/bench_compress_accuracy.py --quick --out /tmp/acc.json

``--compress none`` is a dry run of the script itself: the "compressed" runs use
``compress=None`` too, so every error must print as 0 and every bitwise check as yes.
Without a ``compress`` keyword in ``offload.ActivationOffloader`` the script stops at
once and says so. ``--parts ref`` or ``--parts gpt`` runs one part; ``--no-control``
skips the second uncompressed GPT run; ``--steps``, ``--gpt-layers``, ``--data-mb``
change part 2. By default (the library's default ``compress_filter``) fp32 tensors
(SDPA's logsumexp, norm statistics, fp32 activations under autocast) travel exactly and
only bf16/fp16 ones as fp8. ``--compress-fp32``: the compressed runs pass
``compress_filter=lambda t: True``, so fp32 tensors are compressed too; the label
becomes ``compress='fp8' (fp32 too)``.

``compress="fp8"`` quantizes every offloaded floating tensor to ``float8_e4m3fn`` with one
fp32 scale per 128 consecutive elements before the device -> host copy and dequantizes
it after the reload. The forward runs on the original tensors, so the loss of a step is
unchanged; only its backward sees the quantized copies.

Determinism: ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (unless already set; before any CUDA
work), ``torch.use_deterministic_algorithms(True)`` and ``cudnn.benchmark = False``, so
that run-to-run noise is not read as compression error. Strict (``warn_only=False``,
``--deterministic strict``, the default) as in tests/test_*_cuda.py: with
``warn_only=True`` PyTorch only warns about SDPA's flash-attention backward and keeps its
non-deterministic dQ accumulation, and the controls below would fail on a GPU. Should
an operation have no deterministic implementation, the part it is in starts over with
``warn_only=True`` (a yellow line; ``determinism.fallbacks`` in the JSON) rather than
ending the run. ``--deterministic warn`` / ``off`` choose the others. Every warning is
printed at the end and kept in the JSON (``warnings``); each part has a control that
says whether its runs were in fact deterministic.

Part 1, ``ref-8L`` (docs/performance.md; ``offload.models.ReferenceModel``): 8
Llama-style layers (RMSNorm, fused QKV, causal SDPA, output projection, RMSNorm, SwiGLU
MLP, residuals), hidden 4096, 32 heads, ffn 14336, seq 4096, batch 1, bf16 weights (seed
0); loss = mean of squares of the output, in fp32. ``--quick``: 4 layers, hidden 64, 4
heads, ffn 128, seq 32. One random input ``x`` (seed 1, requires grad). Three ways, each
one warm-up step then the measured forward + backward (gradients freed before each
step): ``none`` (no offloader); ``uncompressed``: ``ActivationOffloader(model.layers,
offload_layers="all", compress=None)``, every layer but the last; ``compressed``: the
same with ``compress="fp8"`` (``--compress``). The offloader's context covers the
layers and the loss; ``min_tensor_bytes`` is the library's default (``--quick``: 0).

* ``uncompressed == none``: ``torch.equal`` on the loss, the input gradient and every
  parameter gradient (the names of those that differ are in the JSON). ``none
  repeated (control)``: the same check between the warm-up and the measured step of
  ``none``: is the step itself deterministic?
* Table "compress='fp8' vs uncompressed", one row per quantity. ``n``: tensors compared;
  ``cos min / median / max``: cosine similarity ``<g_c, g> / (||g_c|| ||g||)`` of the
  compressed run's gradient ``g_c`` and the uncompressed run's ``g``, over the ``n``
  tensors (computed in fp64); ``rel err min / median / max``: ``||g_c - g|| / ||g||``;
  ``worst``: the parameter with the largest rel err. Rows: ``parameter grads`` (every
  parameter), ``input grad`` (``x.grad``), ``loss`` (rel err ``|l_c - l| / |l|``; no
  cosine; 0 expected, see above). The last layer is not offloaded (``"all"`` is all
  but the last) and its gradients are exact, so ``rel err min`` is 0. A yellow line
  warns when the compressed gradients are bitwise equal to the uncompressed ones
  (compression inactive).
* Table "per layer": ``offloaded`` (the uncompressed run's stats), ``params``, and
  ``cos min``, ``rel err median``, ``rel err max`` over the parameters of that layer.
* Bytes: ``stats.bytes_offloaded`` of each offloaded run (what crossed the link) and
  their ratio; ``stats.bytes_by_dtype`` of the compressed run; every ``OffloadStats``
  attribute whose name contains "compress" (read with ``getattr``: today
  ``compress_bytes_before`` / ``compress_bytes_after``, the compressed spans before and
  after compression) and, when both exist, ``after / before``. The JSON has each run's
  full ``stats.to_dict()``.
* ``step ms``: the measured step alone (CUDA events; ``perf_counter`` on the CPU), after
  one warm-up step: information only (step times are bench_activations.py's job).

Part 2, char-level GPT: ``--gpt-layers`` (4) pre-norm blocks (LayerNorm, fused QKV with
bias, causal SDPA, output projection, LayerNorm, GELU MLP of width 4 d, residuals),
d_model 256, 4 heads, context 256, learned positions, byte vocabulary (256), output head
tied to the embedding; weights N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 L)).
Data: the ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` (without
``site-packages`` / ``dist-packages``), sorted by relative path, concatenated and cut at
``--data-mb`` (8) MiB; the first 90 % trains, the last 10 % validates (Python version,
file range, size and sha256 of the text are in the JSON: another Python gives another
text). Batches: 32 windows of 257 bytes whose offsets are drawn once (seed 2) for all
steps and shared by every run. Training: 500 steps of AdamW (lr 1e-3, betas 0.9/0.95,
weight decay 0.1 on matrices and embeddings), linear warm-up over 25 steps then cosine
decay to 1e-4, gradient norm clipped to 1.0, bf16 autocast on CUDA (fp32 on the CPU);
the offloader ``ActivationOffloader(model.blocks, offload_layers="all",
min_tensor_bytes=0, compress=...)`` covers forward and loss. Validation: mean
cross-entropy over 16 fixed batches (evenly spaced windows of the validation text) at
step 0, every 50 steps and after the last. ``--quick``: 3 layers, d_model 64, 2 heads,
context 64, batch 8, 100 steps, validation every 20 over 4 batches, 1 MiB of text.
Runs, each from seed 0 on the same batches: ``uncompressed`` (``compress=None``),
``compressed`` (``compress="fp8"``), ``control`` (``uncompressed`` again).

* Table "char-GPT training", one row per run. ``compress``: its value; ``final train
  (last 20)``: mean of the last 20 training losses; ``vs uncompressed``: ``(final -
  final_uncompressed) / final_uncompressed``; ``final val``: validation loss after the
  last step, and its ``vs uncompressed`` likewise; ``max |dloss|``: the largest
  per-step absolute difference of the training loss from the uncompressed run's;
  ``bitwise``: every training loss, validation loss and final parameter ``torch.equal``
  to the uncompressed run's; ``ms / step``: wall time of the training steps
  (validation excluded) / steps, information only; ``offloaded / step``:
  ``stats.bytes_offloaded`` of the last step.
* Table "validation loss": every validation loss of every run, by step.
* Verdict: ``final train loss within 1 %``: ``|final train vs uncompressed| <= 1 %`` for
  the compressed run; ``final val loss within 1 %`` likewise; ``control bitwise
  identical to uncompressed``: the control's ``bitwise`` (no: the runs are not
  deterministic on this machine, and part of the compressed run's difference is noise).
* Every training loss, gradient norm (before clipping) and validation loss of every run
  is in the JSON (``gpt.runs.<run>.train_loss``, ``grad_norm``, ``val``), for
  ``benchmarks/compress/plot_compress_loss.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import inspect
import json
import math
import os
import statistics
import sys
import sysconfig
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import offload
from benchmarks._common import Timer, environment, free_cached, synchronize, write_json
from offload.models import ReferenceModel
from offload.profiling import format_bytes

REF_DTYPE = torch.bfloat16
LAST_N = 20  # training losses averaged for the final loss
TOLERANCE = 0.01  # "within 1 %"


@dataclasses.dataclass(frozen=True)
class RefConfig:
    """Sizes of the ref-8L model of part 1."""

    layers: int = 8
    hidden: int = 4096
    heads: int = 32
    ffn: int = 14336
    seq: int = 4096
    batch: int = 1


REF_QUICK = RefConfig(layers=4, hidden=64, heads=4, ffn=128, seq=32, batch=1)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Sizes and training settings of the char-level GPT of part 2."""

    layers: int = 4
    d_model: int = 256
    heads: int = 4
    context: int = 256
    batch: int = 32
    steps: int = 500
    val_every: int = 50
    val_batches: int = 16
    warmup: int = 25
    lr: float = 1e-3
    min_lr: float = 1e-4
    weight_decay: float = 0.1
    clip: float = 1.0
    data_bytes: int = 8 * 2**20
    vocab: int = 256


GPT_QUICK = GPTConfig(
    layers=3,
    d_model=64,
    heads=2,
    context=64,
    batch=8,
    steps=100,
    val_every=20,
    val_batches=4,
    warmup=5,
    data_bytes=2**20,
)


# --------------------------------------------------------------------------------------
# the offloader, with or without compress=


def compress_supported() -> bool:
    """Whether this checkout's ``ActivationOffloader`` takes a ``compress`` keyword."""
    return "compress" in inspect.signature(offload.ActivationOffloader).parameters


def every_float(tensor: torch.Tensor) -> bool:
    """``compress_filter`` of ``--compress-fp32``: every floating tensor, fp32 included."""
    return True


def make_offloader(
    layers: Sequence[nn.Module], compress: str | None, keep_fp32: bool, **kwargs: Any
) -> offload.ActivationOffloader:
    """``ActivationOffloader(layers, offload_layers="all", compress=compress, **kwargs)``,
    with ``compress_filter=every_float`` when compressing with ``compress_fp32``.

    ``compress=None`` is passed explicitly when the keyword exists and left out when it
    does not (the library is then lossless anyway). A rejected ``compress`` exits with a
    message instead of a traceback from deep inside the run.
    """
    if compress is not None or compress_supported():
        kwargs["compress"] = compress
    if compress is not None and keep_fp32:
        kwargs["compress_filter"] = every_float
    try:
        return offload.ActivationOffloader(layers, offload_layers="all", **kwargs)
    except (TypeError, ValueError) as exc:
        if "compress" not in str(exc):
            raise
        raise SystemExit(
            f"offload.ActivationOffloader rejected compress={compress!r}: {exc}\n"
            "This checkout may predate compressed offloading; run with --compress none "
            "for a dry run of the script (every error is then 0)."
        ) from exc


def compression_fields(stats: Any) -> dict[str, Any]:
    """Every public, non-callable attribute of ``stats`` whose name contains "compress"
    (the bytes before/after compression, whatever the field ends up being called)."""
    found: dict[str, Any] = {}
    for name in dir(stats):
        if name.startswith("_") or "compress" not in name.lower():
            continue
        value = getattr(stats, name, None)
        if callable(value):
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            value = repr(value)
        found[name] = value
    return found


def stats_record(offloader: offload.ActivationOffloader) -> dict[str, Any]:
    """The JSON-ready stats of the offloader's most recent step."""
    stats = offloader.stats
    fields = compression_fields(stats)
    before = fields.get("compress_bytes_before")
    after = fields.get("compress_bytes_after")
    return {
        "bytes_offloaded": stats.bytes_offloaded,
        "bytes_reloaded": stats.bytes_reloaded,
        "bytes_by_dtype": dict(stats.bytes_by_dtype),
        "compression_fields": fields,
        "compression_ratio": after / before
        if isinstance(before, int | float) and isinstance(after, int | float) and before
        else None,
        "offloaded_layers": [la.index for la in stats.layers if la.offloaded],
        "stats": stats.to_dict(),
    }


# --------------------------------------------------------------------------------------
# comparisons


def compare(got: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    """Cosine similarity, relative error and max abs error of ``got`` against ``ref``,
    computed in fp64; ``equal``: ``torch.equal``."""
    a = got.detach().double().flatten()
    b = ref.detach().double().flatten()
    norm_a = torch.linalg.vector_norm(a).item()
    norm_b = torch.linalg.vector_norm(b).item()
    diff = a - b
    err = torch.linalg.vector_norm(diff).item()
    if norm_a and norm_b:
        cosine = torch.dot(a, b).item() / (norm_a * norm_b)
    else:
        cosine = 1.0 if norm_a == norm_b else float("nan")
    if norm_b:
        rel = err / norm_b
    else:
        rel = 0.0 if err == 0 else float("inf")
    return {
        "cosine": cosine,
        "rel_error": rel,
        "max_abs_error": diff.abs().max().item() if diff.numel() else 0.0,
        "norm": norm_a,
        "norm_ref": norm_b,
        "equal": torch.equal(got, ref),
    }


def spread(values: Sequence[float]) -> dict[str, float]:
    """Min, median and max of ``values`` (NaN-free; empty gives NaNs)."""
    if not values:
        return dict.fromkeys(("min", "median", "max"), float("nan"))
    return {
        "min": float(min(values)),
        "median": float(statistics.median(values)),
        "max": float(max(values)),
    }


def unequal_names(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names of the tensors of ``a`` that are not ``torch.equal`` to those of ``b``."""
    return [name for name in a if not torch.equal(a[name], b[name])]


# --------------------------------------------------------------------------------------
# part 1: ref-8L, one step


def ref_step(
    model: ReferenceModel, x: torch.Tensor, offloader: offload.ActivationOffloader | None
) -> dict[str, torch.Tensor]:
    """Forward + backward from freed gradients; returns loss, ``x.grad`` and parameter
    gradients by name (the tensors themselves: the model's ``.grad`` are unset after)."""
    model.zero_grad(set_to_none=True)
    x.grad = None
    with offloader if offloader is not None else contextlib.nullcontext():
        loss = model.loss(x)
    loss.backward()
    out = {"loss": loss.detach(), "input_grad": x.grad}
    for name, p in model.named_parameters():
        out[name] = p.grad
    model.zero_grad(set_to_none=True)
    x.grad = None
    return out


def run_ref(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Part 1: no offload, uncompressed and compressed offload of one step, compared."""
    cfg: RefConfig = args.ref
    torch.manual_seed(args.seed)
    model = ReferenceModel(
        cfg.layers, cfg.hidden, cfg.heads, cfg.ffn, device=device, dtype=REF_DTYPE
    )
    gen = torch.Generator(device).manual_seed(args.seed + 1)
    x = torch.randn(
        cfg.batch, cfg.seq, cfg.hidden, device=device, dtype=REF_DTYPE, generator=gen
    ).requires_grad_(True)
    timer = Timer(device)
    kwargs = (
        {} if args.ref_min_tensor_bytes is None else {"min_tensor_bytes": args.ref_min_tensor_bytes}
    )

    results: dict[str, dict[str, torch.Tensor]] = {}
    runs: dict[str, dict[str, Any]] = {}
    none_warmup: dict[str, torch.Tensor] | None = None
    for mode, compress in (("none", None), ("uncompressed", None), ("compressed", args.compress)):
        offloader = (
            None
            if mode == "none"
            else make_offloader(model.layers, compress, args.compress_fp32, **kwargs)
        )
        warm = ref_step(model, x, offloader)
        if mode == "none":
            none_warmup = warm
        del warm
        synchronize(device)
        start = timer.mark()
        results[mode] = ref_step(model, x, offloader)
        end = timer.mark()
        synchronize(device)
        runs[mode] = {
            "compress": compress,
            "offloaded": mode != "none",
            "loss": results[mode]["loss"].item(),
            "step_ms": timer.elapsed_ms(start, end),
        }
        if offloader is not None:
            runs[mode].update(stats_record(offloader))
            offloader.close()
        print(f"  ref: {mode}: loss {runs[mode]['loss']:.6g}, step {runs[mode]['step_ms']:.1f} ms")

    assert none_warmup is not None
    none_repeat_unequal = unequal_names(results["none"], none_warmup)
    del none_warmup
    unc_unequal = unequal_names(results["uncompressed"], results["none"])
    comp_unequal = unequal_names(results["compressed"], results["uncompressed"])

    names = [name for name, _ in model.named_parameters()]
    per_param = {
        name: compare(results["compressed"][name], results["uncompressed"][name]) for name in names
    }
    input_grad = compare(results["compressed"]["input_grad"], results["uncompressed"]["input_grad"])
    loss_cmp = compare(results["compressed"]["loss"], results["uncompressed"]["loss"])
    offloaded = set(runs["uncompressed"]["offloaded_layers"])
    per_layer = []
    for i in range(cfg.layers):
        mine = [per_param[n] for n in names if n.startswith(f"layers.{i}.")]
        per_layer.append(
            {
                "layer": i,
                "offloaded": i in offloaded,
                "params": len(mine),
                "cosine": spread([m["cosine"] for m in mine]),
                "rel_error": spread([m["rel_error"] for m in mine]),
            }
        )
    worst = max(names, key=lambda n: per_param[n]["rel_error"])
    sent_unc = runs["uncompressed"]["bytes_offloaded"]
    sent_comp = runs["compressed"]["bytes_offloaded"]
    return {
        "model": dataclasses.asdict(cfg),
        "dtype": str(REF_DTYPE),
        "min_tensor_bytes": args.ref_min_tensor_bytes,
        "runs": runs,
        "uncompressed_equals_none": not unc_unequal,
        "uncompressed_unequal_to_none": unc_unequal,
        "none_repeat_equal": not none_repeat_unequal,
        "none_repeat_unequal": none_repeat_unequal,
        "compressed_equals_uncompressed": not comp_unequal,
        "compressed_vs_uncompressed": {
            "params": per_param,
            "input_grad": input_grad,
            "loss": loss_cmp,
            "summary": {
                "cosine": spread([m["cosine"] for m in per_param.values()]),
                "rel_error": spread([m["rel_error"] for m in per_param.values()]),
                "worst_param": worst,
            },
            "per_layer": per_layer,
        },
        "bytes": {
            "uncompressed": sent_unc,
            "compressed": sent_comp,
            "ratio": sent_comp / sent_unc if sent_unc else None,
        },
    }


# --------------------------------------------------------------------------------------
# part 2: char-level GPT


class GPTBlock(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP, residuals."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.fc_out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [b, heads, t, head_dim]
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class CharGPT(nn.Module):
    """Byte-level GPT: token + position embeddings, ``blocks``, final LayerNorm, tied head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(GPTBlock(cfg.d_model, cfg.heads) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.ndim == 2:
                std = (
                    0.02 / math.sqrt(2 * cfg.layers)
                    if name.endswith(("proj.weight", "fc_out.weight"))
                    else 0.02
                )
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def load_stdlib_text(limit: int) -> tuple[bytes, dict[str, Any]]:
    """The first ``limit`` bytes of the standard library's ``.py`` files, concatenated
    in the order of their sorted relative paths, and where they came from."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages"}
    files = sorted(
        (p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts)),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    chunks, total, used = [], 0, []
    for path in files:
        if total >= limit:
            break
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        used.append(path)
        total += len(data)
    text = b"".join(chunks)[:limit]
    if len(text) < limit:
        print(f"  gpt: only {len(text)} bytes of stdlib source under {root} (asked {limit})")
    info = {
        "stdlib": str(root),
        "python": sys.version.split()[0],
        "files_available": len(files),
        "files_used": len(used),
        "first_file": used[0].relative_to(root).as_posix() if used else None,
        "last_file": used[-1].relative_to(root).as_posix() if used else None,
        "bytes": len(text),
        "sha256": hashlib.sha256(text).hexdigest(),
    }
    return text, info


def lr_at(cfg: GPTConfig, step: int) -> float:
    """Linear warm-up over ``cfg.warmup`` steps, then cosine decay to ``cfg.min_lr``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def windows(
    data: torch.Tensor, starts: torch.Tensor, context: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets of the windows starting at ``starts``."""
    chunk = data[starts[:, None] + torch.arange(context + 1, device=data.device)].long()
    return chunk[:, :-1], chunk[:, 1:]


@dataclasses.dataclass
class GPTData:
    """Train and validation bytes on the device, and the fixed window offsets."""

    train: torch.Tensor
    val: torch.Tensor
    batches: torch.Tensor  # [steps, batch] start offsets into train
    val_batches: torch.Tensor  # [val_batches, batch] start offsets into val


def autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast on CUDA; nothing (fp32) elsewhere."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(model: CharGPT, data: GPTData, cfg: GPTConfig, device: torch.device) -> float:
    """Mean cross-entropy over the fixed validation batches."""
    total = torch.zeros((), device=device)
    for starts in data.val_batches:
        x, y = windows(data.val, starts, cfg.context)
        with autocast(device):
            logits = model(x)
        total += F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    return (total / len(data.val_batches)).item()


def train(
    cfg: GPTConfig,
    data: GPTData,
    device: torch.device,
    compress: str | None,
    keep_fp32: bool,
    seed: int,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """One training run from ``seed``; returns its record and its final parameters."""
    torch.manual_seed(seed)
    model = CharGPT(cfg).to(device)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    offloader = make_offloader(model.blocks, compress, keep_fp32, min_tensor_bytes=0)
    losses = torch.zeros(cfg.steps, device=device)
    norms = torch.zeros(cfg.steps, device=device)
    val: list[tuple[int, float]] = [(0, evaluate(model, data, cfg, device))]
    eval_s = 0.0
    synchronize(device)
    start = time.perf_counter()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step)
        x, y = windows(data.train, data.batches[step], cfg.context)
        with offloader, autocast(device):
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        norms[step] = nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses[step] = loss.detach()
        if (step + 1) % cfg.val_every == 0 or step + 1 == cfg.steps:
            t0 = time.perf_counter()
            val.append((step + 1, evaluate(model, data, cfg, device)))
            eval_s += time.perf_counter() - t0
    synchronize(device)
    wall = time.perf_counter() - start
    record: dict[str, Any] = {
        "compress": compress,
        "train_loss": losses.tolist(),
        "grad_norm": norms.tolist(),
        "val": val,
        "seconds": wall,
        "eval_seconds": eval_s,
        "ms_per_step": (wall - eval_s) / cfg.steps * 1e3,
    }
    record.update(stats_record(offloader))
    offloader.close()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    record["_losses"] = losses
    return record, params


def final_train(record: dict[str, Any]) -> float:
    """Mean of the last ``LAST_N`` training losses."""
    return statistics.fmean(record["train_loss"][-LAST_N:])


def run_gpt(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Part 2: train the char-level GPT uncompressed, with fp8, and (control) again."""
    cfg: GPTConfig = args.gpt
    text, info = load_stdlib_text(cfg.data_bytes)
    need = 2 * (cfg.context + 2)
    n_train = int(0.9 * len(text))
    if n_train < need or len(text) - n_train < need:
        raise SystemExit(f"not enough text for context {cfg.context}: {len(text)} bytes")
    raw = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    gen = torch.Generator().manual_seed(args.seed + 2)
    batches = torch.randint(0, n_train - cfg.context, (cfg.steps, cfg.batch), generator=gen)
    n_val = len(text) - n_train
    val_starts = torch.linspace(
        0, n_val - cfg.context - 1, cfg.val_batches * cfg.batch, dtype=torch.float64
    )
    data = GPTData(
        train=raw[:n_train].to(device),
        val=raw[n_train:].to(device),
        batches=batches.to(device),
        val_batches=val_starts.long().view(cfg.val_batches, cfg.batch).to(device),
    )
    info.update(train_bytes=n_train, val_bytes=n_val)
    print(
        f"  gpt: {info['bytes'] / 2**20:.2f} MiB of {info['files_used']} files under "
        f"{info['stdlib']} ({info['first_file']} .. {info['last_file']})"
    )

    plan = [("uncompressed", None), ("compressed", args.compress)]
    if args.control:
        plan.append(("control", None))
    runs: dict[str, dict[str, Any]] = {}
    params: dict[str, dict[str, torch.Tensor]] = {}
    for name, compress in plan:
        runs[name], params[name] = train(cfg, data, device, compress, args.compress_fp32, args.seed)
        print(
            f"  gpt: {name}: final train {final_train(runs[name]):.4f}, val "
            f"{runs[name]['val'][-1][1]:.4f}, {runs[name]['ms_per_step']:.1f} ms/step"
        )

    base = runs["uncompressed"]
    curves = {name: rec.pop("_losses") for name, rec in runs.items()}
    for name, rec in runs.items():
        losses, ref_losses = curves[name], curves["uncompressed"]
        rec["final_train"] = final_train(rec)
        rec["final_val"] = rec["val"][-1][1]
        rec["final_train_rel_diff"] = (rec["final_train"] - final_train(base)) / final_train(base)
        rec["final_val_rel_diff"] = (rec["final_val"] - base["val"][-1][1]) / base["val"][-1][1]
        rec["max_abs_loss_diff"] = (losses - ref_losses).abs().max().item()
        rec["first_loss_equal"] = bool(torch.equal(losses[0], ref_losses[0]))
        rec["bitwise_equal_to_uncompressed"] = bool(
            torch.equal(losses, ref_losses)
            and rec["val"] == base["val"]
            and not unequal_names(params[name], params["uncompressed"])
        )
    comp = runs["compressed"]
    return {
        "model": dataclasses.asdict(cfg),
        "autocast": "bfloat16" if device.type == "cuda" else None,
        "data": info,
        "runs": runs,
        "final_train_rel_diff": comp["final_train_rel_diff"],
        "final_val_rel_diff": comp["final_val_rel_diff"],
        "final_train_within_1pct": abs(comp["final_train_rel_diff"]) <= TOLERANCE,
        "final_val_within_1pct": abs(comp["final_val_rel_diff"]) <= TOLERANCE,
        "control_bitwise_identical": runs["control"]["bitwise_equal_to_uncompressed"]
        if "control" in runs
        else None,
        "compressed_bitwise_identical": comp["bitwise_equal_to_uncompressed"],
    }


# --------------------------------------------------------------------------------------
# report


def _yes(flag: bool | None) -> str:
    return "n/a" if flag is None else ("[green]yes[/green]" if flag else "[red]no[/red]")


def _g(value: float) -> str:
    return f"{value:.6f}" if math.isfinite(value) else str(value)


def _e(value: float) -> str:
    return f"{value:.2e}" if math.isfinite(value) else str(value)


def _table(title: str, columns: Sequence[str], left: Sequence[str] = ()) -> Any:
    from rich.table import Table

    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="left" if col in left else "right")
    return table


def print_ref(console: Any, ref: dict[str, Any], label: str, name: str) -> None:
    """Part 1: the checks, the two tables, the bytes."""
    m, runs = ref["model"], ref["runs"]
    console.print(
        f"\n[bold]part 1[/bold]: {name} (layers {m['layers']}, hidden {m['hidden']}, heads "
        f"{m['heads']}, ffn {m['ffn']}, seq {m['seq']}, batch {m['batch']}, bf16), one "
        f"forward + backward, offload_layers='all', min_tensor_bytes "
        f"{ref['min_tensor_bytes'] if ref['min_tensor_bytes'] is not None else 'default'}"
    )
    differ = ref["uncompressed_unequal_to_none"]
    console.print(
        "uncompressed == none (torch.equal: loss, input grad, every param grad): "
        + _yes(ref["uncompressed_equals_none"])
        + (f" (differ: {', '.join(differ[:5])})" if differ else "")
        + f"; none repeated (control): {_yes(ref['none_repeat_equal'])}"
    )
    cmp = ref["compressed_vs_uncompressed"]
    summ = cmp["summary"]
    table = _table(
        f"{label} vs uncompressed: gradients of one step",
        ("quantity", "n", "cos min", "cos median", "cos max")
        + ("rel err min", "rel err median", "rel err max", "worst"),
        left=("quantity", "worst"),
    )
    worst = summ["worst_param"] if summ["rel_error"]["max"] > 0 else "-"
    table.add_row(
        "parameter grads",
        str(len(cmp["params"])),
        *(_g(summ["cosine"][k]) for k in ("min", "median", "max")),
        *(_e(summ["rel_error"][k]) for k in ("min", "median", "max")),
        worst,
    )
    ig, lc = cmp["input_grad"], cmp["loss"]
    table.add_row("input grad", "1", *[_g(ig["cosine"])] * 3, *[_e(ig["rel_error"])] * 3, "")
    table.add_row("loss", "1", "-", "-", "-", *[_e(lc["rel_error"])] * 3, "")
    console.print(table)

    per = _table(
        "per layer (parameter grads)",
        ("layer", "offloaded", "params", "cos min", "rel err median", "rel err max"),
    )
    for row in cmp["per_layer"]:
        per.add_row(
            str(row["layer"]),
            "yes" if row["offloaded"] else "no",
            str(row["params"]),
            _g(row["cosine"]["min"]),
            _e(row["rel_error"]["median"]),
            _e(row["rel_error"]["max"]),
        )
    console.print(per)
    sent = ref["bytes"]
    ratio = f" ({sent['ratio']:.3f}x)" if sent["ratio"] is not None else ""
    console.print(
        f"bytes_offloaded per step: uncompressed {format_bytes(sent['uncompressed'])}, "
        f"{label} {format_bytes(sent['compressed'])}{ratio}; by dtype ({label}): "
        f"{runs['compressed']['bytes_by_dtype']}"
    )
    fields = runs["compressed"]["compression_fields"]
    ratio = runs["compressed"]["compression_ratio"]
    console.print(
        f"OffloadStats fields named *compress* ({label} run): "
        + (", ".join(f"{k}={v}" for k, v in fields.items()) if fields else "none found")
        + (f"; after / before = {ratio:.4f}" if ratio is not None else "")
    )
    console.print(
        "step ms (1 step after 1 warm-up, information only): "
        + ", ".join(f"{mode} {run['step_ms']:.1f}" for mode, run in runs.items())
    )
    if ref["compressed_equals_uncompressed"] and runs["compressed"]["compress"] is not None:
        console.print(
            f"[yellow]{label} gave gradients bitwise equal to the uncompressed run: is "
            "compression active in this checkout?[/yellow]"
        )


def print_gpt(console: Any, gpt: dict[str, Any], label: str) -> None:
    """Part 2: the runs, the validation curve, the verdict."""
    m, data = gpt["model"], gpt["data"]
    console.print(
        f"\n[bold]part 2[/bold]: char-GPT (layers {m['layers']}, d_model {m['d_model']}, "
        f"heads {m['heads']}, context {m['context']}, batch {m['batch']}, "
        f"{'bf16 autocast' if gpt['autocast'] else 'fp32'}), {m['steps']} AdamW steps on "
        f"{data['bytes'] / 2**20:.2f} MiB of Python {data['python']} stdlib source "
        f"(sha256 {data['sha256'][:12]}), offload_layers='all', min_tensor_bytes 0"
    )
    table = _table(
        "char-GPT training, same seed and batches",
        ("run", "compress", f"final train (last {LAST_N})", "vs uncompressed", "final val")
        + ("vs uncompressed ", "max |dloss|", "bitwise", "ms / step", "offloaded / step"),
        left=("run",),
    )
    for name, rec in gpt["runs"].items():
        table.add_row(
            name,
            repr(rec["compress"]),
            f"{rec['final_train']:.4f}",
            f"{rec['final_train_rel_diff']:+.3%}",
            f"{rec['final_val']:.4f}",
            f"{rec['final_val_rel_diff']:+.3%}",
            f"{rec['max_abs_loss_diff']:.2e}",
            "yes" if rec["bitwise_equal_to_uncompressed"] else "no",
            f"{rec['ms_per_step']:.1f}",
            format_bytes(rec["bytes_offloaded"]),
        )
    console.print(table)
    vals = _table("validation loss", ("step", *gpt["runs"]))
    for i, (step, _) in enumerate(gpt["runs"]["uncompressed"]["val"]):
        vals.add_row(str(step), *(f"{rec['val'][i][1]:.4f}" for rec in gpt["runs"].values()))
    console.print(vals)
    console.print(
        f"{label}: final train loss within 1 %: {_yes(gpt['final_train_within_1pct'])} "
        f"({gpt['final_train_rel_diff']:+.3%}); final val loss within 1 %: "
        f"{_yes(gpt['final_val_within_1pct'])} ({gpt['final_val_rel_diff']:+.3%}); "
        f"control bitwise identical to uncompressed: {_yes(gpt['control_bitwise_identical'])}"
    )
    if gpt["compressed_bitwise_identical"] and gpt["runs"]["compressed"]["compress"] is not None:
        console.print(
            f"[yellow]{label} trained bitwise like the uncompressed run: is compression "
            "active in this checkout?[/yellow]"
        )


def print_report(result: dict[str, Any]) -> None:
    """Header, both parts and the warnings, with rich."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    env, settings = result["environment"], result["settings"]
    label = f"compress={settings['compress']!r}"
    if settings["compress"] is None:
        label += " (dry run)"
    elif settings.get("keep_fp32"):
        label += " (fp32 too)"
    where = f"{env['gpu']} ({env['device']})" if "gpu" in env else env["device"]
    det = result["determinism"]
    console.print(
        f"[bold]bench_compress_accuracy[/bold]: {label} on {where}, torch {env['torch']} "
        f"(CUDA {env['torch_cuda'] or 'n/a'}), offload {env['offload']}; deterministic "
        f"algorithms: {det['mode']}, CUBLAS_WORKSPACE_CONFIG={det['CUBLAS_WORKSPACE_CONFIG']}"
    )
    for fallback in det["fallbacks"]:
        console.print(
            f"[yellow]part {fallback['part']}: strict determinism refused an operation, the "
            f"part ran again with warn_only=True:[/yellow] {fallback['error'][:300]}",
        )
    if "ref" in result:
        print_ref(console, result["ref"], label, settings["ref_name"])
    if "gpt" in result:
        print_gpt(console, result["gpt"], label)
    if result["warnings"]:
        console.print(f"warnings ({len(result['warnings'])}, also in the JSON):")
        for text in result["warnings"]:
            console.print(f"  {text}", markup=False)
    console.print(
        "Definitions of every column: header of benchmarks/compress/bench_compress_accuracy.py; "
        "plot: benchmarks/compress/plot_compress_loss.py."
    )


# --------------------------------------------------------------------------------------
# main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Every setting and column: the header of this script.",
    )
    parser.add_argument("--out", required=True, help="path of the JSON result")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes for a CPU smoke run (ref: 4 layers, hidden 64, min_tensor_bytes "
        "0; gpt: 3 layers, d_model 64, 100 steps, 1 MiB of text)",
    )
    parser.add_argument(
        "--device", default=None, help="cuda or cpu (default: cuda when available, else cpu)"
    )
    parser.add_argument(
        "--compress",
        default="fp8",
        help="compress= of the compressed runs (default fp8); 'none': a dry run "
        "(compress=None everywhere, every error 0)",
    )
    parser.add_argument(
        "--deterministic",
        choices=("strict", "warn", "off"),
        default="strict",
        help="torch.use_deterministic_algorithms: strict (True; a part that meets an "
        "operation without a deterministic implementation starts over with warn), warn "
        "(True, warn_only=True: SDPA flash backward stays non-deterministic), off "
        "(default strict)",
    )
    parser.add_argument(
        "--compress-fp32",
        action="store_true",
        help="compressed runs compress fp32 tensors too (compress_filter=lambda t: True; "
        "by default they travel exactly)",
    )
    parser.add_argument(
        "--parts", default="ref,gpt", help="comma-separated among ref,gpt (default both)"
    )
    parser.add_argument("--seed", type=int, default=0, help="base seed (default 0)")
    parser.add_argument(
        "--ref-min-tensor-bytes",
        type=int,
        default=None,
        help="min_tensor_bytes of part 1 (default: the library's; --quick: 0)",
    )
    parser.add_argument("--gpt-layers", type=int, default=None, help="GPT blocks (default 4)")
    parser.add_argument("--steps", type=int, default=None, help="GPT training steps (default 500)")
    parser.add_argument(
        "--data-mb", type=float, default=None, help="MiB of stdlib text (default 8)"
    )
    parser.add_argument(
        "--no-control",
        dest="control",
        action="store_false",
        help="skip the second uncompressed GPT run",
    )
    args = parser.parse_args(argv)

    args.compress = None if args.compress.lower() == "none" else args.compress
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts or parts - {"ref", "gpt"}:
        parser.error(f"--parts {args.parts!r}: comma-separated among ref,gpt")
    args.parts = [p for p in ("ref", "gpt") if p in parts]
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
        if args.device == "cpu" and not args.quick:
            parser.error("no CUDA device: the full sizes need a GPU; use --quick (or --device cpu)")
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available here; use --quick (it runs on the CPU)")
    if args.device.type not in ("cuda", "cpu"):
        parser.error(f"--device {args.device}: only cuda and cpu are supported")
    if args.device.type == "cuda" and args.device.index is None:
        args.device = torch.device("cuda", torch.cuda.current_device())

    args.ref = REF_QUICK if args.quick else RefConfig()
    args.ref_name = "ref (quick)" if args.quick else "ref-8L"
    if args.quick and args.ref_min_tensor_bytes is None:
        args.ref_min_tensor_bytes = 0
    gpt = GPT_QUICK if args.quick else GPTConfig()
    if args.gpt_layers is not None:
        gpt = dataclasses.replace(gpt, layers=args.gpt_layers)
    if args.steps is not None:
        gpt = dataclasses.replace(gpt, steps=args.steps)
    if args.data_mb is not None:
        gpt = dataclasses.replace(gpt, data_bytes=int(args.data_mb * 2**20))
    if gpt.steps < LAST_N:
        parser.error(f"--steps {gpt.steps}: at least {LAST_N} (the final loss averages them)")
    if gpt.layers < 2:
        parser.error("--gpt-layers: at least 2 (offload_layers='all' never offloads the last)")
    args.gpt = gpt
    return args


@contextlib.contextmanager
def recording_warnings(into: list[str]) -> Iterator[None]:
    """Print warnings as usual and also append each one, once, to ``into``."""
    shown = warnings.showwarning

    def record(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        text = f"{category.__name__}: {message} ({Path(filename).name}:{lineno})"
        if text not in into:
            into.append(text)
        shown(message, category, filename, lineno, *rest)

    warnings.showwarning = record
    try:
        yield
    finally:
        warnings.showwarning = shown


def set_determinism(mode: str) -> None:
    """``strict``: deterministic algorithms, an error where there is none; ``warn``: the
    same but only a warning (and SDPA's flash backward stays non-deterministic);
    ``off``: PyTorch's default."""
    torch.use_deterministic_algorithms(mode != "off", warn_only=mode == "warn")


def determinism_state() -> dict[str, Any]:
    """What PyTorch is set to now."""
    return {
        "use_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
    }


def run_part(
    name: str,
    part: Callable[[argparse.Namespace, torch.device], dict[str, Any]],
    args: argparse.Namespace,
    result: dict[str, Any],
) -> None:
    """Run one part into ``result[name]``; in ``strict`` mode an operation without a
    deterministic implementation makes the part start over with ``warn_only=True``
    (recorded in ``result["determinism"]["fallbacks"]``) instead of ending the run."""
    t0 = time.perf_counter()
    try:
        result[name] = part(args, args.device)
    except RuntimeError as exc:
        if not (
            torch.are_deterministic_algorithms_enabled()
            and not torch.is_deterministic_algorithms_warn_only_enabled()
            and "deterministic" in str(exc)
        ):
            raise
        print(f"  {name}: strict determinism refused an operation; again with warn_only=True")
        result["determinism"]["fallbacks"].append({"part": name, "error": str(exc)[:2000]})
        set_determinism("warn")
        free_cached(args.device)
        result[name] = part(args, args.device)
    result[name]["determinism"] = determinism_state()
    result["seconds"][name] = time.perf_counter() - t0
    free_cached(args.device)


def main(argv: Sequence[str] | None = None) -> None:
    # cuBLAS reads this when its first handle is made: before any CUDA work.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    args = parse_args(argv)
    device = args.device
    if args.compress is not None and not compress_supported():
        raise SystemExit(
            "offload.ActivationOffloader has no `compress` keyword in this checkout "
            f"(offload/activations.py), so compress={args.compress!r} cannot be measured. "
            "Run with --compress none for a dry run of the script (every error is then 0)."
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif args.quick:
        torch.set_num_threads(1)  # tiny ops: threads only add contention
    set_determinism(args.deterministic)
    torch.backends.cudnn.benchmark = False

    result: dict[str, Any] = {
        "benchmark": "bench_compress_accuracy",
        "command": [sys.executable, *sys.argv],
        "settings": {
            "compress": args.compress,
            "keep_fp32": args.compress_fp32,
            "compress_keyword": compress_supported(),
            "parts": args.parts,
            "quick": args.quick,
            "seed": args.seed,
            "ref_name": args.ref_name,
            "gpt_control": args.control,
            "cpu_threads": torch.get_num_threads(),
        },
        "determinism": {
            "mode": args.deterministic,
            "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            **determinism_state(),
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "fallbacks": [],
        },
        "environment": environment(device),
        "warnings": [],
        "seconds": {},
    }
    if device.type == "cuda":
        cuda = torch.backends.cuda
        result["determinism"]["sdpa_backends_enabled"] = {
            "flash": cuda.flash_sdp_enabled(),
            "mem_efficient": cuda.mem_efficient_sdp_enabled(),
            "cudnn": cuda.cudnn_sdp_enabled(),
            "math": cuda.math_sdp_enabled(),
        }
    with recording_warnings(result["warnings"]):
        if "ref" in args.parts:
            run_part("ref", run_ref, args, result)
        if "gpt" in args.parts:
            run_part("gpt", run_gpt, args, result)
    print_report(result)
    write_json(args.out, result)
    seconds = result["seconds"]
    print(f"wrote {args.out} ({', '.join(f'{k} {v:.1f} s' for k, v in seconds.items())})")


if __name__ == "__main__":
    main()
