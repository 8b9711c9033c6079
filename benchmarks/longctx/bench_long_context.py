"""Long-context training on one GPU: step time, tokens/s, activation peak, host memory
and the longest sequence, for this package's levers and the tools users pick instead.

Commands (from the repository root)::

    # 16k and 32k tokens, every method, both models (one process each)
    PYTHONPATH=. python3 benchmarks/longctx/bench_long_context.py --out benchmarks/results/long_context.json
    # a cheaper first look: one model, a few methods, 16k
    PYTHONPATH=. python3 benchmarks/longctx/bench_long_context.py --models llama-8b-lora \\
        --methods hf-ckpt,ours-ckpt,ours-ckpt-head,ours-ckpt-head-tile --seqs 16384 --out /tmp/lc.json
    # the longest sequence each method trains (3 steps), doubling from 16k
    PYTHONPATH=. python3 benchmarks/longctx/bench_long_context.py --longest --max-seq 131072 --out /tmp/longest.json
    # CPU smoke run (tiny models; what tests/recompute/test_bench_long_context.py runs)
    PYTHONPATH=. python3 benchmarks/longctx/bench_long_context.py --quick --device cpu --out /tmp/q.json

Models (Hugging Face ``LlamaForCausalLM`` from a config, random weights, SDPA, batch 1,
loss = the model's causal LM loss with ``labels=input_ids``):

- ``llama-1b``: hidden 2048, 16 layers, 32 heads, 4 KV heads, ffn 5632, vocab 32000;
  bf16 weights, every parameter trained.
- ``llama-8b-lora``: hidden 4096, 32 layers, 32 heads, 8 KV heads, ffn 14336, vocab
  128256; bf16 frozen base, PEFT LoRA r=16 (alpha 32) on q/k/v/o_proj.

Methods: ``none``; ``hf-ckpt`` (``gradient_checkpointing_enable(gradient_checkpointing_
kwargs={"use_reentrant": False})``); ``hf-ckpt-offload`` (the same with
``offload=True``, where the installed transformers has it); ``ours-default``
(``ActivationOffloader(find_layers(model))``, "auto"); ``ours-ckpt``
(``offload_checkpointing``); ``ours-ckpt-head`` (+ ``sliced_head_loss``);
``ours-ckpt-head-tile`` (+ ``tile_mlp``); ``ours-ckpt-head-liger`` (``ours-ckpt-head``
with ``sliced_head_loss(backend="liger")``: Liger-Kernel's fused kernel, CUDA only);
``ours-plan`` (``offload.plan`` at
``--plan-budget-gib`` of activation peak, default 1.9, head slices of
``--slice-tokens``, default 1024; CUDA only; the planning time is in the row); peers (``--methods`` names; each row records
``peer``, ``peer_version`` and ``loaded_as``):

- ``trl-offload`` / ``trl-offload-ckpt`` (TRL 1.16): one
  ``trl.models.activation_offloading.get_act_offloading_ctx_manager(model)`` entered
  around forward and backward of every step, as ``SFTTrainer.training_step`` does;
  without / with HF non-reentrant checkpointing. Loaded as
  ``import trl.models.activation_offloading`` (trl's top level is lazy).
- ``deepspeed-ckpt-offload`` (DeepSpeed 0.19.8): HF non-reentrant checkpointing + one
  ``CheckpointHiddenStatesOffload()`` (``deepspeed.runtime.activation_checkpointing.
  offload_activations``) entered around forward and backward: each checkpointed decoder
  layer's input goes to pinned host memory. ``import deepspeed`` whole (no ops built; no
  ``deepspeed.comm`` set up: none of these calls need it).
- ``deepspeed-ckpt-offload-tiled``: the same + DeepSpeed's long-sequence tiling from
  ``deepspeed/runtime/sequence_parallel/ulysses_sp.py`` as ALST uses it on one GPU:
  every ``LlamaMLP.forward`` through ``TiledMLP`` (``ceil(seq / hidden)`` shards) and
  the loss through ``TiledFusedLogitsLoss`` on the decoder's last hidden state (about
  1 GiB of fp32 logits per shard, ``"sum"`` of per-shard ``loss_function(...,
  shift_labels=...)`` times its label count, divided by the label count).
- ``unsloth-zoo`` / ``unsloth-zoo-nofused`` (unsloth_zoo 2026.10.9):
  ``patch_unsloth_smart_gradient_checkpointing(dtype)`` + HF reentrant checkpointing
  (its ``UnslothCheckpointFunction``: layer inputs offloaded to pinned host buffers);
  ``unsloth-zoo`` also has its fused LM-head cross-entropy: ``unsloth_zoo.fused_losses.
  forward_install`` rewrites ``LlamaForCausalLM.forward`` (its AST "triplet" rewrite, the
  install ``import unsloth_zoo`` does on an accelerator when ``UNSLOTH_FUSED_FORWARD`` is
  not ``0``) so that the loss is ``unsloth_fused_lm_head_loss(hidden_states, lm_head,
  labels)``, i.e. ``unsloth_fused_ce_loss``: chunked, gradients computed in the forward,
  no full logits (``outputs.logits`` is empty); ``-nofused`` sets
  ``UNSLOTH_FUSED_FORWARD=0`` before the import, so HF's forward and loss stay. Loaded as
  ``import unsloth_zoo`` whole; its ``__init__`` refuses to load unless the ``unsloth``
  package is findable and ``UNSLOTH_IS_PRESENT`` is set, so where ``unsloth`` is not
  installed an empty stand-in module named ``unsloth`` answers that check (nothing of
  ``unsloth`` itself runs: no ``FastLanguageModel``, no Unsloth model patches).

A peer that is not installed is recorded as skipped with the reason; one that fails
(on a CPU: TRL's streams, unsloth_zoo's pinned buffers) is an ``error`` row with it.
``benchmarks/longctx/check_peers.py`` prints, in seconds, whether each peer loads.
Where there is no network, the peers come as wheels in ``.whl/`` (ignored by git)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \\
        --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site

with trl 1.16.0, unsloth_zoo 2026.10.9, deepspeed 0.19.8 (a ``py3-none-any`` wheel
built from its sdist with ``DS_BUILD_OPS=0``) and what ``import deepspeed`` needs beyond
torch's usual company: hjson, pydantic, pydantic_core (cp312), annotated_types,
typing_inspection.

One process per configuration: the parent runs ``python3 <this script> --worker ...``
for each (model, method, length) and reads back its JSON. Per configuration: the median
step time (forward + backward, gradients zeroed between steps, not freed) of
``--steps`` steps after ``--warmup``, tokens/s, the activation peak
(``max_memory_allocated`` during a step minus what was allocated before it, the largest
over the measured steps), the host RSS high-water mark (psutil, sampled every 20 ms),
or ``oom`` (``torch.OutOfMemoryError``, the worker exits 0), ``killed`` (a signal: on a
host out of memory the kernel kills the process), ``timeout`` or ``error``.
``--longest`` doubles the length from 16,384 (3 steps, no warm-up) until a method
fails or passes ``--max-seq``. Prints a table; ``--out`` is rewritten after every
configuration, so a run cut short keeps the rows it finished. Where a device limits
each command's time, split the run with ``--models``, ``--methods`` and ``--seqs`` and
pass ``--append`` to collect the parts in one file (a configuration measured again
replaces its row). The tables of README.md and docs/long-context.md are rendered from
``benchmarks/results/long_context.json`` by ``benchmarks/longctx/render.py``, which
takes each method's longest length from its rows: the longest that trained, and what
stopped the next one tried.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.machinery
import importlib.util
import inspect
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

GIB = 1024**3
MODELS = ("llama-1b", "llama-8b-lora")
METHODS = (
    "none",
    "hf-ckpt",
    "hf-ckpt-offload",
    "ours-default",
    "ours-ckpt",
    "ours-ckpt-head",
    "ours-ckpt-head-tile",
    "ours-ckpt-head-liger",
    "ours-plan",
    "trl-offload",
    "trl-offload-ckpt",
    "deepspeed-ckpt-offload",
    "deepspeed-ckpt-offload-tiled",
    "unsloth-zoo",
    "unsloth-zoo-nofused",
)
#: The package each peer method needs (checked in the parent: no process is started
#: for a method whose package is missing).
PEER_PACKAGES = {
    "trl-offload": "trl",
    "trl-offload-ckpt": "trl",
    "deepspeed-ckpt-offload": "deepspeed",
    "deepspeed-ckpt-offload-tiled": "deepspeed",
    "unsloth-zoo": "unsloth_zoo",
    "unsloth-zoo-nofused": "unsloth_zoo",
    "ours-ckpt-head-liger": "liger_kernel",
}
SHAPES = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=4, vocab_size=32000),
    "llama-8b-lora": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
}  # fmt: skip
#: ``--quick``: the same kinds of model at a size a CPU trains in a fraction of a second.
QUICK_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256)  # fmt: skip
LONGEST_START, QUICK_START = 16384, 64


# ---- the worker: one configuration in this process ----------------------------------------


def build_model(name: str, seq: int, device: torch.device, quick: bool) -> torch.nn.Module:
    """The model ``name`` on ``device`` (bf16 on CUDA, fp32 on the CPU), training mode.

    Raises:
        ImportError: ``llama-8b-lora`` without ``peft``.
    """
    import transformers

    shape = dict(QUICK_SHAPE if quick else SHAPES[name])
    config = transformers.LlamaConfig(
        **shape, max_position_embeddings=max(seq, 4096), use_cache=False, attention_dropout=0.0
    )
    config._attn_implementation = "sdpa"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in place on the device, in its dtype
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    if name == "llama-8b-lora":
        import peft

        model.requires_grad_(False)
        lora = peft.LoraConfig(
            r=16,
            lora_alpha=32,
            lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            task_type="CAUSAL_LM",
        )
        model = peft.get_peft_model(model, lora)
    return model.train()


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The ``LlamaForCausalLM`` (inside a PEFT wrapper or not)."""
    for module in model.modules():  # PEFT's PeftModelForCausalLM is the wrapper, not it
        cls = type(module)
        if cls.__name__.endswith("ForCausalLM") and not cls.__module__.startswith("peft"):
            return module
    raise TypeError(f"no *ForCausalLM in {type(model).__name__}")


def _hf_checkpointing(causal: torch.nn.Module, reentrant: bool = False, **extra: Any) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # renamed in transformers 5.x
        causal.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant}, **extra
        )
    if reentrant and not causal.get_input_embeddings().weight.requires_grad:
        causal.enable_input_require_grads()  # reentrant checkpointing needs a grad input


def hf_offload_supported() -> bool:
    """Whether transformers' checkpointing takes ``offload=True``."""
    from transformers import PreTrainedModel

    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        fn = getattr(PreTrainedModel, name, None)
        if fn is not None and "offload" in inspect.signature(fn).parameters:
            return True
    return False


# ---- peers: imported as their users load them ------------------------------------------


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def import_peer(method: str) -> dict[str, Any]:
    """Import the package ``method`` runs the way its users load it.

    Returns:
        Facts for the row: ``peer`` (the package), ``peer_version`` and ``loaded_as``
        (how it was imported, where that is not a plain ``import <package>``).

    Raises:
        ImportError: the package (or one it needs) is not installed.
    """
    package = PEER_PACKAGES[method]
    facts: dict[str, Any] = {"peer": package}
    if package == "trl":
        # trl's top level is lazy: this loads trl/__init__ and the one module, as
        # SFTTrainer's own `from ..models.activation_offloading import ...` does.
        import trl.models.activation_offloading  # noqa: F401

        facts["loaded_as"] = "import trl.models.activation_offloading (trl's lazy top level)"
    elif package == "deepspeed":
        import deepspeed  # noqa: F401

        facts["loaded_as"] = "import deepspeed (whole package, no ops built)"
    elif package == "unsloth_zoo":
        # unsloth_zoo/__init__ refuses to load unless the `unsloth` package is findable
        # and UNSLOTH_IS_PRESENT is set (`import unsloth` sets it, then imports
        # unsloth_zoo). `unsloth` itself (its FastLanguageModel, its model patches) is
        # not used here: an empty stand-in answers the find_spec check where it is missing.
        os.environ.setdefault("UNSLOTH_IS_PRESENT", "1")
        stub = getattr(sys.modules.get("unsloth"), "stand_in", False)
        if stub or importlib.util.find_spec("unsloth") is None:
            if not stub:
                module = types.ModuleType("unsloth")
                module.__spec__ = importlib.machinery.ModuleSpec("unsloth", None, is_package=True)
                module.__path__, module.stand_in = [], True
                sys.modules["unsloth"] = module
            facts["loaded_as"] = (
                "import unsloth_zoo (whole package) with UNSLOTH_IS_PRESENT=1 and an empty "
                "stand-in `unsloth` module (unsloth not installed)"
            )
        else:
            import unsloth  # noqa: F401  (as users load it: unsloth first)

            facts["loaded_as"] = "import unsloth; import unsloth_zoo"
        import unsloth_zoo  # noqa: F401
    elif package == "liger_kernel":
        # what sliced_head_loss(backend="liger") imports
        import liger_kernel.transformers.fused_linear_cross_entropy  # noqa: F401

        facts["loaded_as"] = "import liger_kernel.transformers.fused_linear_cross_entropy"
    else:
        raise NotImplementedError(f"{method!r} is not a peer method")
    facts["peer_version"] = getattr(sys.modules[package], "__version__", None) or _version(package)
    return facts


def _unsloth_fused_forward(forward_install: Any, cls: type) -> dict[str, Any]:
    """Install unsloth_zoo's fused LM-head cross-entropy forward on ``cls``.

    ``import unsloth_zoo`` runs ``install_modeling_import_hook()`` itself on an
    accelerator (not on a CPU backend), which rewrites the ``forward`` of every
    ``*ForCausalLM`` class already imported or imported later; called here as well, so
    that the CPU runs the same code, and checked: the class must be patched.

    Raises:
        NotImplementedError: the installer left ``cls`` alone (the reason it gives).
    """
    forward_install.install_modeling_import_hook()
    forward_install.install_for_class(cls)
    audit = forward_install.audit()
    name = cls.__qualname__
    patched = audit["patched"].get(name)
    if patched is None:
        reason = audit["unmatched"].get(name) or audit["failed"].get(name) or "not patched"
        raise NotImplementedError(f"unsloth_zoo's fused forward skipped {name}: {reason}")
    return {"tier": patched.get("tier"), "head_attr": patched.get("head_attr")}


def _deepspeed_tiling(causal: torch.nn.Module, quick: bool) -> dict[str, Any]:
    """DeepSpeed's long-sequence tiling on an HF Llama, as ALST (Arctic Long Sequence
    Training) sets it up on one GPU: every ``LlamaMLP.forward`` runs through
    ``TiledMLP`` (``ceil(seq / hidden)`` shards, the example in its docstring) and the
    causal LM's loss through ``TiledFusedLogitsLoss`` over the decoder's last hidden
    state (``output_reduction="sum"``, about 1 GiB of fp32 logits per shard, each shard
    ``loss_function(..., shift_labels=...) * its label count``, the sum divided by the
    labels: ArcticTraining's SFT loss without the sequence-parallel gather).
    ``quick``: shards of 16 tokens for both, so that the tiny sequences are tiled.
    """
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP
    from transformers.modeling_outputs import CausalLMOutputWithPast

    def mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def tiled_mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        seqlen, hidden = x.shape[-2], x.shape[-1]
        shards = math.ceil(seqlen / (16 if quick else hidden))
        params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
        return TiledMLP.apply(mlp_forward, self, x, shards, params)

    mlps = [m for m in causal.modules() if type(m).__name__ == "LlamaMLP"]
    for mlp in mlps:
        mlp.forward = types.MethodType(tiled_mlp_forward, mlp)

    vocab = causal.config.vocab_size

    def shard_loss(head: torch.nn.Module, hidden: torch.Tensor, shift: torch.Tensor):
        logits = head.lm_head(hidden)
        if (shift == -100).all():
            return (logits.sum() * 0.0).float()
        loss = head.loss_function(logits=logits, labels=None, vocab_size=vocab, shift_labels=shift)
        return loss * (shift != -100).sum()

    def forward(input_ids=None, labels=None, **kwargs: Any) -> Any:
        kwargs = {k: v for k, v in kwargs.items() if v is not None and k != "return_dict"}
        hidden = causal.model(input_ids=input_ids, use_cache=False, **kwargs).last_hidden_state
        if labels is None:
            return CausalLMOutputWithPast(logits=causal.lm_head(hidden))
        shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        bs, seqlen = shift.shape
        shards = math.ceil(seqlen / 16) if quick else math.ceil(bs * seqlen * vocab * 4 / 2**30)
        total = TiledFusedLogitsLoss.apply(
            shard_loss, causal, hidden, shift, None, shards, [causal.lm_head.weight], "sum"
        )
        return CausalLMOutputWithPast(loss=total / (shift != -100).sum())

    causal.forward = forward  # a PEFT wrapper calls the instance's forward
    return {"tiled_mlps": len(mlps), "tiled_loss": "TiledFusedLogitsLoss"}


def apply_method(
    method: str, model: torch.nn.Module, quick: bool = False, info: dict | None = None
) -> tuple[Callable[[], Any], bool, dict]:
    """Set ``method`` up on ``model`` (``quick``: tiles of 16 tokens, so that the tiny
    sequences of ``--quick`` are tiled; ``info``: filled with the facts for the row as
    they are known, so that a failure part-way keeps them).

    Returns:
        ``(context, around_backward, info)``: a factory of the context each step's
        forward runs in, whether the backward runs inside it too, and facts for the row.

    Raises:
        NotImplementedError: the method cannot run here (the reason is the message).
    """
    import offload
    from offload.integrations.hf import offload_checkpointing

    causal = causal_lm(model)
    info = {} if info is None else info
    if method == "none":
        return contextlib.nullcontext, False, info
    if method == "hf-ckpt":
        _hf_checkpointing(causal)
        return contextlib.nullcontext, False, info
    if method == "hf-ckpt-offload":
        if not hf_offload_supported():
            raise NotImplementedError(
                "this transformers has no gradient checkpointing offload=True"
            )
        _hf_checkpointing(causal, offload=True)
        return contextlib.nullcontext, False, info
    if method == "ours-plan":  # planned in the worker, on the step's input (plan_on)
        return contextlib.nullcontext, False, info
    if method == "ours-default":
        offloader = offload.ActivationOffloader(offload.find_layers(causal))
        info["offloader"] = offloader
        return lambda: offloader, False, info
    if method.startswith("ours-ckpt"):
        offload_checkpointing(causal)
        if "head" in method:
            backend = "liger" if method.endswith("-liger") else "torch"
            if backend == "liger":
                info.update(import_peer(method))
            offload.sliced_head_loss(model, backend=backend)
        if "tile" in method:
            offload.tile_mlp(causal, tile_tokens=16 if quick else "auto")
        return contextlib.nullcontext, False, info
    if method.startswith("trl-offload"):
        info.update(import_peer(method))
        from trl.models.activation_offloading import get_act_offloading_ctx_manager

        if method == "trl-offload-ckpt":
            _hf_checkpointing(causal)
        # One manager for the run, entered around every step, as SFTTrainer does (it is
        # built once: building it registers hooks on the LM head).
        manager = get_act_offloading_ctx_manager(model)
        return lambda: manager, True, info
    if method.startswith("deepspeed-ckpt-offload"):
        info.update(import_peer(method))
        from deepspeed.runtime.activation_checkpointing.offload_activations import (
            CheckpointHiddenStatesOffload,
        )

        _hf_checkpointing(causal)
        if method.endswith("-tiled"):
            info.update(_deepspeed_tiling(causal, quick))
        hidden_offload = CheckpointHiddenStatesOffload()  # its pinned buffer pool lives on
        return lambda: hidden_offload, True, info
    if method.startswith("unsloth-zoo"):
        fused = not method.endswith("nofused")
        # Read by unsloth_zoo's fused-forward installer (on unless "0").
        os.environ["UNSLOTH_FUSED_FORWARD"] = "1" if fused else "0"
        info.update(import_peer(method))
        from unsloth_zoo.fused_losses import forward_install
        from unsloth_zoo.gradient_checkpointing import patch_unsloth_smart_gradient_checkpointing

        if fused:
            info["fused_forward"] = _unsloth_fused_forward(forward_install, type(causal))
        elif forward_install.audit()["patched"].get(type(causal).__qualname__):
            raise NotImplementedError("UNSLOTH_FUSED_FORWARD=0 but the fused forward is on")
        patch_unsloth_smart_gradient_checkpointing(dtype=next(causal.parameters()).dtype)
        _hf_checkpointing(causal, reentrant=True)
        return contextlib.nullcontext, False, info
    raise NotImplementedError(f"unknown method {method!r}")


@contextlib.contextmanager
def host_high_water() -> Iterator[dict[str, float]]:
    """Samples this process's RSS every 20 ms; ``result["peak_gib"]`` on exit."""
    import psutil

    proc, result, stop = psutil.Process(), {"peak_gib": 0.0}, threading.Event()

    def sample() -> None:
        while not stop.is_set():
            result["peak_gib"] = max(result["peak_gib"], proc.memory_info().rss / GIB)
            stop.wait(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join()
        result["peak_gib"] = max(result["peak_gib"], proc.memory_info().rss / GIB)


def measure(model, ids, device, context, around_backward, args, settled=None) -> dict[str, Any]:
    """``args.warmup`` steps (more, up to 20, while ``settled()`` is false: "auto"'s own
    measuring steps), then ``args.steps`` timed forward + backward steps."""
    cuda = device.type == "cuda"

    def one_step() -> tuple[float, int | None, float]:
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        with context():
            loss = model(input_ids=ids, labels=ids).loss
            if around_backward:
                loss.backward()
        if not around_backward:
            loss.backward()
        if cuda:
            torch.cuda.synchronize(device)
        elapsed = (time.perf_counter() - start) * 1e3
        model.zero_grad(set_to_none=False)  # kept allocated: the peak is above them
        peak = torch.cuda.max_memory_allocated(device) - before if cuda else None
        return elapsed, peak, loss.item()

    warm = 0
    while warm < args.warmup or (settled is not None and not settled() and warm < args.warmup + 20):
        one_step()
        warm += 1
    runs = [one_step() for _ in range(args.steps)]
    times = sorted(r[0] for r in runs)
    mid = len(times) // 2
    median = times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2
    peaks = [r[1] for r in runs if r[1] is not None]
    return {
        "step_ms": median,
        "step_ms_all": [r[0] for r in runs],
        "activation_peak_gib": max(peaks) / GIB if peaks else None,
        "loss": runs[-1][2],
        "warmup_steps_run": warm,
    }


def _auto_settled(offloader: Any) -> bool:
    """Whether "auto" has made its choice (``stats.auto`` stays ``None`` where it is not
    on, such as on a CPU)."""
    return (offloader.stats.auto or {"phase": "settled"}).get("phase") == "settled"


def plan_on(model: torch.nn.Module, ids: torch.Tensor, device: torch.device,
            args: argparse.Namespace, info: dict[str, Any]) -> None:  # fmt: skip
    """``ours-plan``: ``offload.plan`` of the step at ``--plan-budget-gib`` (its head and
    tiling levers allowed, slices of ``--slice-tokens``), applied to ``model``.

    Raises:
        NotImplementedError: not on CUDA (the planner measures on CUDA only).
    """
    import offload

    if device.type != "cuda":
        raise NotImplementedError("offload.plan measures on CUDA only")

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    start = time.perf_counter()
    plan = offload.plan(step, offload.find_layers(causal_lm(model)),
                        budget=int(args.plan_budget_gib * GIB), model=model,
                        slice_tokens=args.slice_tokens)  # fmt: skip
    model.zero_grad(set_to_none=False)
    plan.apply(model)
    info.update(plan_s=time.perf_counter() - start, plan_summary=plan.summary(),
                plan_budget_gib=args.plan_budget_gib)  # fmt: skip


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One configuration; every outcome is a row (never raises on OOM)."""
    device = torch.device(args.device)
    row: dict[str, Any] = {"model": args.model, "method": args.method, "seq": args.seq}
    info: dict[str, Any] = {}
    with host_high_water() as host:
        try:
            model = build_model(args.model, args.seq, device, args.quick)
            context, around_backward, info = apply_method(args.method, model, args.quick, info)
            vocab = causal_lm(model).config.vocab_size
            g = torch.Generator().manual_seed(1)
            ids = torch.randint(0, vocab, (1, args.seq), generator=g).to(device)
            if args.method == "ours-plan":
                plan_on(model, ids, device, args, info)
            offloader = info.get("offloader")
            settled = None if offloader is None else functools.partial(_auto_settled, offloader)
            result = measure(model, ids, device, context, around_backward, args, settled)
            row.update(result, status="ok", tokens_per_s=args.seq / (result["step_ms"] / 1e3))
            if offloader is not None:
                auto = offloader.stats.auto or {}
                row.update(bytes_offloaded=offloader.stats.bytes_offloaded,
                           auto_phase=auto.get("phase"), auto_chosen=str(auto.get("chosen")))  # fmt: skip
        except torch.OutOfMemoryError as exc:
            row.update(status="oom", reason=str(exc).split("\n")[0][:300])
        except (ImportError, NotImplementedError) as exc:
            row.update(status="skipped", reason=f"{type(exc).__name__}: {exc}"[:300])
        except Exception as exc:
            text = str(exc).strip()
            if isinstance(exc, RuntimeError) and "out of memory" in text.lower():
                row.update(status="oom", reason=text.split("\n")[0][:300])  # cuBLAS/cuDNN
            else:  # a row, not a crash: the reason in it, the traceback on stderr
                traceback.print_exc()
                row.update(status="error", reason=f"{type(exc).__name__}: {text}"[:400])
    row.update({k: v for k, v in info.items() if k != "offloader"})  # peer, version, ...
    row["host_peak_gib"] = host["peak_gib"]
    if device.type == "cuda":
        row["device_name"] = torch.cuda.get_device_name(device)
    return row


# ---- the parent: one process per configuration ------------------------------------------


def peer_missing(method: str, device: torch.device) -> str | None:
    """Why ``method`` cannot run in this environment, or ``None``."""
    package = PEER_PACKAGES.get(method)
    if package and importlib.util.find_spec(package) is None:
        return f"{package} is not installed"
    if method == "hf-ckpt-offload" and not hf_offload_supported():
        return "the installed transformers has no gradient checkpointing offload=True"
    if method == "ours-ckpt-head-liger" and device.type != "cuda":
        return "Liger-Kernel's Triton kernel needs CUDA"
    if method == "hf-ckpt-offload" and device.type != "cuda":
        return "its save_on_cpu(pin_memory=True) needs an accelerator"
    return None


def spawn(
    args: argparse.Namespace, model: str, method: str, seq: int, warmup: int, steps: int
) -> dict:
    """Run one configuration in a child process; its row, or a row saying how it ended."""
    row: dict[str, Any] = {"model": model, "method": method, "seq": seq}
    reason = peer_missing(method, torch.device(args.device))
    if reason:
        return {**row, "status": "skipped", "reason": reason}
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "row.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", model,
               "--method", method, "--seq", str(seq), "--warmup", str(warmup),
               "--steps", str(steps), "--device", args.device, "--result", result,
               "--plan-budget-gib", str(args.plan_budget_gib),
               "--slice-tokens", str(args.slice_tokens)]  # fmt: skip
        if args.quick:
            cmd.append("--quick")
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
        )
        try:
            proc = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=args.timeout
            )
        except subprocess.TimeoutExpired:
            return {**row, "status": "timeout", "reason": f"over {args.timeout} s"}
        if os.path.exists(result):
            with open(result) as f:
                return json.load(f)
    if proc.returncode < 0:
        return {**row, "status": "killed", "reason": f"signal {-proc.returncode} (host memory?)"}
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {**row, "status": "error", "reason": " | ".join(tail)[-400:]}


def longest(args, model: str, method: str) -> dict[str, Any]:
    """Double the length until ``method`` fails or passes ``--max-seq``."""
    seq, best, tried = (QUICK_START if args.quick else LONGEST_START), None, []
    while seq <= args.max_seq:
        row = spawn(args, model, method, seq, warmup=0, steps=3)
        tried.append(row)
        print(_line(row), flush=True)
        if row["status"] != "ok":
            break
        best, seq = row, seq * 2
    last = tried[-1] if tried else {}
    stopped = "max-seq" if last.get("status") == "ok" else last.get("status")
    return {
        "model": model,
        "method": method,
        "longest_seq": best["seq"] if best else None,
        "tokens_per_s_at_longest": best["tokens_per_s"] if best else None,
        "activation_peak_gib_at_longest": best.get("activation_peak_gib") if best else None,
        "host_peak_gib_at_longest": best.get("host_peak_gib") if best else None,
        "stopped_by": stopped,
        "reason": last.get("reason"),
        "tried": tried,
    }


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _line(row: dict[str, Any]) -> str:
    if row.get("status") != "ok":
        return f"{row['model']:14} {row['method']:24} {row['seq']:>7}  {row['status']}: {row.get('reason', '')}"
    return (
        f"{row['model']:14} {row['method']:24} {row['seq']:>7}  {row['step_ms']:9.1f} ms "
        f"{row['tokens_per_s']:9.0f} tok/s  act {_fmt(row.get('activation_peak_gib'), '.2f')} GiB"
        f"  host {row['host_peak_gib']:.1f} GiB"
    )


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one line per configuration, step time relative to ``none``."""
    base = {
        (r["model"], r["seq"]): r["step_ms"]
        for r in rows
        if r["method"] == "none" and r["status"] == "ok"
    }
    out = ["| model | method | seq | step ms | x none | tokens/s | activation peak GiB | host peak GiB | status |",
           "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        ok = r["status"] == "ok"
        ratio = base.get((r["model"], r["seq"])) if ok else None
        out.append(
            f"| {r['model']} | {r['method']} | {r['seq']} | {_fmt(r.get('step_ms') if ok else None, '.1f')} "
            f"| {_fmt(r['step_ms'] / ratio if ratio else None, '.2f')} "
            f"| {_fmt(r.get('tokens_per_s') if ok else None, '.0f')} "
            f"| {_fmt(r.get('activation_peak_gib'), '.2f')} | {_fmt(r.get('host_peak_gib'), '.1f')} "
            f"| {r['status'] if ok else r['status'] + ': ' + str(r.get('reason', ''))[:80]} |"
        )
    return "\n".join(out)


def longest_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: the longest sequence per (model, method) and what stopped it."""
    out = ["| model | method | longest seq | tokens/s there | activation peak GiB | host peak GiB | stopped by |",
           "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        out.append(
            f"| {r['model']} | {r['method']} | {_fmt(r['longest_seq'], 'd')} "
            f"| {_fmt(r['tokens_per_s_at_longest'], '.0f')} | {_fmt(r['activation_peak_gib_at_longest'], '.2f')} "
            f"| {_fmt(r['host_peak_gib_at_longest'], '.1f')} | {r['stopped_by']} |"
        )
    return "\n".join(out)


def _key(row: dict[str, Any]) -> tuple[Any, ...]:
    return row["model"], row["method"], row.get("seq")


def _names(text: str, known: tuple[str, ...], flag: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise SystemExit(f"{flag}: unknown {bad or 'empty'}; accepted: {', '.join(known)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--seqs", default=None, help="default 16384,32768 (--quick: 64)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--longest", action="store_true", help="double the length until OOM")
    p.add_argument("--max-seq", type=int, default=131072, help="--longest stops here")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per configuration")
    p.add_argument("--quick", action="store_true", help="tiny models (CPU smoke run)")
    p.add_argument("--out", default=None)
    p.add_argument("--plan-budget-gib", type=float, default=1.9, help="ours-plan's budget")
    p.add_argument("--slice-tokens", type=int, default=1024, help="ours-plan's head slices")
    p.add_argument(
        "--append",
        action="store_true",
        help="keep the rows already in --out (one measured again is replaced)",
    )
    # the child's arguments
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error(f"--steps must be >= 1 and --warmup >= 0; got {args.steps}, {args.warmup}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        row = worker(args)
        with open(args.result, "w") as f:
            json.dump(row, f)
        return 0
    from benchmarks._common import results

    models = _names(args.models, MODELS, "--models")
    methods = _names(args.methods, METHODS, "--methods")
    seqs = [int(s) for s in (args.seqs or ("64" if args.quick else "16384,32768")).split(",")]
    rows: list[dict[str, Any]] = []
    if args.append and args.out and os.path.exists(args.out):
        with open(args.out) as f:
            rows = json.load(f)["rows"]  # a row measured again below replaces its old one
    if args.longest:
        for model in models:
            for method in methods:
                rows.append(longest(args, model, method))
                results("long_context_longest", args, rows)
        print(longest_table(rows))
    else:
        for model in models:
            for seq in seqs:
                for method in methods:
                    row = spawn(args, model, method, seq, args.warmup, args.steps)
                    rows = [r for r in rows if _key(r) != _key(row)] + [row]
                    print(_line(row), flush=True)
                    results("long_context", args, rows)  # a cut-off run keeps its rows
        print(table(rows))
    results("long_context_longest" if args.longest else "long_context", args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
