"""Hugging Face models under :class:`offload.ActivationOffloader`: bitwise-equal training.

Each test builds a tiny model from a random config (no downloads; fp32; eager
attention; dropout 0; ``model.train()``), deep-copies it as the reference, and runs two
training steps on both with the same inputs and the same SGD update: the offloaded
copy runs its forward inside ``with offloader:`` and its backward outside. After each
step the loss and every parameter gradient must be ``torch.equal`` to the reference
(and not ``None``), and the offloader's stats must show the expected bytes per layer.

Models: Llama (dense), Qwen2-MoE and Mixtral (MoE; their experts are fused modules in
transformers 5, a ModuleList before), GPT-2 (``transformer.h``, learned positions).
Modes: no activation checkpointing, and HF activation checkpointing with
``use_reentrant=True``, ``use_reentrant=False`` and the library default (which this
file reports: ``True`` in transformers 4.35-4.x, ``False`` in 5.x).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import offload

transformers = pytest.importorskip("transformers")

BATCH, SEQ, HIDDEN, LAYERS, VOCAB = 2, 16, 32, 3, 64
MODELS = ["llama", "qwen2_moe", "mixtral", "gpt2"]
MODES = ["plain", "reentrant", "non_reentrant", "hf_default"]


def _hooks_outside_checkpoint() -> bool:
    """Whether HF's checkpointed layers run their module hooks outside the checkpoint.

    transformers 5.24 wraps each layer's ``forward`` in the checkpoint; earlier versions
    (4.57 and 5.17 were tried: ``GradientCheckpointingLayer.__call__``; versions without
    that class called ``checkpoint(layer.__call__, ...)`` in the model's loop) run the
    hooks inside it.
    """
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return False
    return "__call__" not in vars(GradientCheckpointingLayer)


HOOKS_OUTSIDE_CHECKPOINT = _hooks_outside_checkpoint()


def _build(name: str) -> nn.Module:
    t = transformers
    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_dropout=0.0,
        use_cache=False,
        attn_implementation="eager",
    )
    if name == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(**common))
    if name == "qwen2_moe":
        cfg = t.Qwen2MoeConfig(
            **common,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
        )
        return t.Qwen2MoeForCausalLM(cfg)
    if name == "mixtral":
        cfg = t.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
        return t.MixtralForCausalLM(cfg)
    if name == "gpt2":
        cfg = t.GPT2Config(
            vocab_size=VOCAB,
            n_embd=HIDDEN,
            n_layer=LAYERS,
            n_head=4,
            n_positions=SEQ,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
            use_cache=False,
            attn_implementation="eager",
        )
        return t.GPT2LMHeadModel(cfg)
    raise AssertionError(name)  # pragma: no cover


def _enable_checkpointing(model: nn.Module, mode: str) -> bool | None:
    """Turn on HF activation checkpointing; returns the ``use_reentrant`` in effect."""
    if mode == "plain":
        return None
    with warnings.catch_warnings():
        # transformers 5 renamed it activation_checkpointing_enable (FutureWarning)
        warnings.simplefilter("ignore", FutureWarning)
        if mode == "hf_default":
            model.gradient_checkpointing_enable()
        else:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"}
            )
    funcs = {
        getattr(m, "_gradient_checkpointing_func", None)
        for m in model.modules()
        if getattr(m, "gradient_checkpointing", False)
    }
    assert len(funcs) == 1 and None not in funcs, "checkpointing did not reach the layers"
    func = funcs.pop()
    # a functools.partial(checkpoint, use_reentrant=...); torch's own default is True
    return bool(getattr(func, "keywords", {}).get("use_reentrant", True))


def _record_layer_inputs(layers: list[nn.Module]) -> tuple[list[dict[int, int]], list[Any]]:
    """Record, per layer call, ``{storage pointer: bytes}`` of its positional tensor inputs.

    Only positional arguments: HF passes the hidden states (GPT-2 also the mask)
    positionally and the rest by keyword, which its checkpoint wrapper binds with
    ``functools.partial`` instead of saving.
    """
    per_call: list[dict[int, int]] = []

    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        per_call.append(
            {
                a.untyped_storage().data_ptr(): a.untyped_storage().nbytes()
                for a in args
                if isinstance(a, torch.Tensor)
            }
        )

    return per_call, [layer.register_forward_pre_hook(hook) for layer in layers]


def _first_sends(groups: list[dict[int, int]]) -> list[int]:
    """Bytes each group sends when it gets ``groups[g]``: a storage is sent once per step."""
    sent: set[int] = set()
    out = []
    for storages in groups:
        out.append(sum(n for ptr, n in storages.items() if ptr not in sent))
        sent.update(storages)
    return out


def _check_grads(model: nn.Module, ref: nn.Module) -> None:
    pairs = list(zip(model.named_parameters(), ref.named_parameters(), strict=True))
    assert pairs
    for (name, p), (ref_name, q) in pairs:
        assert name == ref_name
        assert p.grad is not None, f"{name}: no gradient with offloading"
        assert q.grad is not None, f"{name}: no gradient in the reference"
        assert torch.equal(p.grad, q.grad), (
            f"{name}: gradients differ, max abs diff {(p.grad - q.grad).abs().max().item()}"
        )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", MODELS)
def test_training_is_bitwise_equal(name: str, mode: str) -> None:
    torch.manual_seed(0)
    model = _build(name)
    model.train()
    use_reentrant = _enable_checkpointing(model, mode)
    ref = copy.deepcopy(model)

    layers = offload.find_layers(model)
    expected_layers = model.transformer.h if name == "gpt2" else model.model.layers
    assert len(layers) == LAYERS and all(
        a is b for a, b in zip(layers, expected_layers, strict=True)
    )
    off = offload.ActivationOffloader(layers, min_tensor_bytes=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)

    for step in range(2):  # the second step reuses the offloader and its host pool
        input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        labels = input_ids.clone()

        ref_loss = ref(input_ids, labels=labels).loss
        ref_loss.backward()

        inputs, handles = _record_layer_inputs(layers)
        with off:
            loss = model(input_ids, labels=labels).loss
        for h in handles:
            h.remove()
        loss.backward()

        assert torch.equal(loss, ref_loss), f"step {step}: {loss.item()} != {ref_loss.item()}"
        _check_grads(model, ref)

        stats = off.stats
        assert [la.offloaded for la in stats.layers] == [True] * (LAYERS - 1) + [False]
        assert stats.layers[-1].bytes_offloaded == 0
        assert stats.bytes_offloaded == sum(la.bytes_offloaded for la in stats.layers)
        assert stats.bytes_kept["small"] == 0  # min_tensor_bytes=0
        # every offloaded byte came back exactly once during the backward
        assert stats.bytes_reloaded == stats.bytes_offloaded
        hidden_bytes = BATCH * SEQ * HIDDEN * 4
        sent = [la.bytes_offloaded for la in stats.layers[:-1]]
        if use_reentrant is None:
            # without checkpointing a layer saves its whole forward: many times its input
            assert all(b > 5 * hidden_bytes for b in sent), sent
            assert stats.bytes_kept["parameter"] > 0  # weight.t() views stay put (4.7)
        else:
            # With checkpointing only the layers' *inputs* reach offload's hooks, never
            # their internals (the backward recomputes those):
            # - use_reentrant=True: CheckpointFunction runs the layer under no_grad, so
            #   nothing inside is saved; the tensor inputs it saves for the recompute
            #   are packed when its forward returns.
            # - use_reentrant=False: the inputs are saved (by _NoopSaveInputs) before
            #   the checkpoint pushes its own saved-tensor hooks; inside the layer those
            #   inner hooks win over offload's outer ones.
            # The inputs are the hidden states (for GPT-2 also the causal mask, passed
            # positionally: sent once, then counted as "shared"). Which group they land
            # in depends on where HF runs the module hooks that open offload's groups:
            if HOOKS_OUTSIDE_CHECKPOINT:
                # recent transformers (5.24) checkpoint `forward`: the hooks run outside,
                # each layer's inputs are saved while its own group is open
                groups = inputs[: LAYERS - 1]
            elif use_reentrant:
                # older ones (4.57, 5.17) checkpoint `__call__`: the hooks run inside (and
                # again, outside the context, in the recompute). Reentrant: the
                # inputs are packed after the layer's group closed, so they belong to
                # the next group (docs/design.md, section 2); layer 0's group saves nothing
                groups = [{}, *inputs[: LAYERS - 2]]
            else:
                # hooks inside, non-reentrant: the inputs are saved before the layer's
                # group opens, so they belong to that group, except layer 0's, saved
                # before the first group ("outside_layers", stays on the device)
                groups = [{}, *inputs[1 : LAYERS - 1]]
            expected = _first_sends(groups)
            assert sent == expected
            assert sum(inputs[0].values()) >= hidden_bytes
            assert all(b > 0 for b in expected[0 if HOOKS_OUTSIDE_CHECKPOINT else 1 :])
            assert stats.bytes_kept["parameter"] == 0  # no weight is saved at all

        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    off.close()


def test_hf_default_use_reentrant_is_reported() -> None:
    """Document which ``use_reentrant`` ``gradient_checkpointing_enable()`` picks here."""
    model = _build("llama")
    use_reentrant = _enable_checkpointing(model, "hf_default")
    major = int(transformers.__version__.split(".")[0])
    # transformers 4.35+ passed use_reentrant=True explicitly; 5.x passes False
    assert use_reentrant is (major < 5)
