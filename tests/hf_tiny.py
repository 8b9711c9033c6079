"""Tiny Hugging Face causal LMs and a training step that returns the loss and every
gradient, shared by ``test_head_loss.py`` and ``test_tiled.py``.

Models are built from a config (random weights, seed fixed, eager attention, dropout 0,
no cache, training mode); comparisons take a deep copy so both runs start from the same
weights.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: fp32: element-wise tolerance of the sliced/tiled computation against the plain one.
FP32 = {"rtol": 1e-5, "atol": 1e-6}
#: bf16: the largest difference, over the largest magnitude of the reference.
BF16_REL = 2e-2


def tiny_llama(
    *,
    vocab: int = 96,
    hidden: int = 32,
    ffn: int = 64,
    layers: int = 2,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    attn: str = "eager",
) -> nn.Module:
    """A ``LlamaForCausalLM`` from a config with random weights (fp32 unless told;
    ``attn="sdpa"`` where long sequences make eager attention's scores the peak)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        attention_dropout=0.0,
        use_cache=False,
        attn_implementation=attn,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).train()


def batch(
    vocab: int, *, seq: int = 37, size: int = 2, device: str = "cpu", seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)``: random tokens; labels are the ids with a few positions
    set to -100 (a prompt masked out, a padded tail)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (size, seq), generator=g)
    labels = ids.clone()
    labels[:, :5] = -100
    labels[-1, -3:] = -100
    return ids.to(device), labels.to(device)


def step(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> tuple:
    """One forward + backward; returns ``(loss, {name: grad}, output)``, gradients
    cleared afterwards so the model can run again."""
    out = model(input_ids=ids, labels=labels, **kwargs)
    out.loss.backward()
    grads = {
        name: p.grad.detach().clone()
        for name, p in model.named_parameters()
        if p.requires_grad and p.grad is not None
    }
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), grads, out


def assert_grads_close(got: dict, want: dict, *, bf16: bool = False) -> None:
    """Same gradient names; each within the fp32 tolerance, or for bf16 within
    ``BF16_REL`` of the reference's largest magnitude."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    for name, ref in want.items():
        assert_close(got[name], ref, bf16=bf16, what=name)


def assert_close(
    got: torch.Tensor, ref: torch.Tensor, *, bf16: bool = False, what: str = ""
) -> None:
    """:data:`FP32` element-wise, or :data:`BF16_REL` of the largest magnitude."""
    if not bf16:
        torch.testing.assert_close(got, ref, **FP32, msg=lambda m: f"{what}: {m}")
        return
    diff = (got.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert diff <= BF16_REL * max(scale, 1e-30), f"{what}: max diff {diff} vs max |ref| {scale}"
