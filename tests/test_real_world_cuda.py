"""Where users already are, on a CUDA GPU: PEFT LoRA on a Hugging Face Llama under an
``ActivationOffloader`` (bitwise), a Lightning ``Trainer`` with ``attach()`` (losses and
parameters equal), a Hugging Face ``Trainer`` with ``attach()`` (parameters bitwise), and
layers compiled one by one with inductor (both compile forms, with the offloader and
with ``offload.checkpoint``: bitwise against the same compiled layers without
offloading). ``offload_checkpointing()`` on a Hugging Face Llama is
``tests/recompute/test_checkpoint_cuda.py::test_hf_llama_bf16_sdpa``.

Deterministic algorithms throughout, and attention written out (softmax of ``q k^T``) or
Hugging Face's ``attn_implementation="eager"``: SDPA's flash backward is not
deterministic at longer sequences, so two runs without offloading could differ.

Run with ``PYTHONPATH=. python3 -m pytest -m cuda tests/test_real_world_cuda.py``
(peft and lightning tests skip with a reason where those packages are missing).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import offload
from tests import models
from tests.models import ON_CUDA_DETERMINISTIC, assert_same

pytestmark = ON_CUDA_DETERMINISTIC

DEV = "cuda"


class EagerAttentionBlock(models.LlamaBlock):
    """``models.LlamaBlock`` with its attention written out (deterministic backward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        a = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        x = x + self.out(a.transpose(1, 2).reshape(b, s, d))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def _blocks(n: int = 4) -> list[nn.Module]:
    torch.manual_seed(0)
    return [EagerAttentionBlock(256, 4, 512).to(DEV, torch.bfloat16) for _ in range(n)]


def _tiny_llama(transformers: Any) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(DEV, torch.bfloat16).train()


# ---- PEFT LoRA -----------------------------------------------------------------------------


def test_peft_lora_on_hf_llama_is_bitwise() -> None:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")

    def lora_model() -> nn.Module:
        model = _tiny_llama(transformers)
        torch.manual_seed(1)  # the adapters' initialisation
        cfg = peft.LoraConfig(
            r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"]
        )
        return peft.get_peft_model(model, cfg)

    model, ref = lora_model(), lora_model()
    layers = offload.find_layers(model)
    assert len(layers) == 4
    off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
    opts = [
        torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
        for m in (model, ref)
    ]
    for it in range(3):
        ids = torch.randint(0, 512, (2, 256), device=DEV)
        with off:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        want = ref(input_ids=ids, labels=ids).loss
        want.backward()
        assert torch.equal(loss, want), it
        pairs = [
            (n, p, q)
            for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True)
            if p.requires_grad
        ]
        assert pairs and all("lora_" in n for n, _, _ in pairs)
        for name, p, q in pairs:
            assert torch.equal(p.grad, q.grad), name
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert off.stats.bytes_offloaded > 0
    off.close()


# ---- Lightning --------------------------------------------------------------------------------


def _lightning() -> Any:
    try:
        import lightning.pytorch as pl
    except ImportError:
        pl = pytest.importorskip("pytorch_lightning")
    return pl


def test_lightning_trainer_with_attach_has_equal_losses() -> None:
    pl = _lightning()

    class Stack(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(_blocks())
            self.losses: list[torch.Tensor] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return models.run_plain(self.layers, x)

        def training_step(self, batch: Any, _index: int) -> torch.Tensor:
            loss = self(batch[0]).float().square().mean()
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(8, 256, 256, generator=g).bfloat16())

    def fit(module: Any) -> None:
        trainer = pl.Trainer(
            accelerator="gpu",
            devices=1,
            max_steps=4,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2, shuffle=False))

    ref, model = Stack(), Stack()
    fit(ref)
    off = offload.ActivationOffloader(list(model.layers), offload_layers="all", min_tensor_bytes=0)
    handle = off.attach(model)
    fit(model)
    assert len(model.losses) == len(ref.losses) == 4
    assert all(torch.equal(a, b) for a, b in zip(model.losses, ref.losses))
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    assert off.stats.bytes_offloaded > 0
    handle.remove()
    off.close()


# ---- Hugging Face Trainer -------------------------------------------------------------------


def test_hf_trainer_with_attach_is_bitwise() -> None:
    from tests.activations.test_attach import trainer_is_bitwise_equal

    trainer_is_bitwise_equal(use_cpu=False)


# ---- per-layer torch.compile with inductor ---------------------------------------------------


def _compiled(form: str) -> tuple[nn.ModuleList, list[nn.Module]]:
    """The stack the forward runs and the modules the offloader is given (as in
    tests/test_compile.py, with inductor)."""
    torch._dynamo.reset()
    inner = _blocks()
    if form == "method":
        for layer in inner:
            layer.compile()
        return nn.ModuleList(inner), inner
    stack = nn.ModuleList(torch.compile(layer) for layer in inner)
    return stack, (inner if form == "wrapper_inner" else list(stack))


@pytest.mark.parametrize("form", ["method", "wrapper", "wrapper_inner"])
def test_per_layer_inductor_with_activation_offloader_is_bitwise(form: str) -> None:
    stack, hooked = _compiled(form)
    off = offload.ActivationOffloader(hooked, offload_layers="all", min_tensor_bytes=0)
    for it in range(3):
        x = torch.randn(2, 512, 256, device=DEV, dtype=torch.bfloat16) + it
        got = models.step(stack, x, models.run_plain, off)
        want = models.step(stack, x, models.run_plain)  # the same compiled layers
        assert_same(got, want)
        stats = off.stats
        assert [la.bytes_offloaded > 0 for la in stats.layers] == [True, True, True, False]
    off.close()


@pytest.mark.parametrize("form", ["method", "wrapper"])
def test_per_layer_inductor_with_offload_checkpoint_is_bitwise(form: str) -> None:
    stack, _ = _compiled(form)
    ckpt = offload.CheckpointOffloader(min_tensor_bytes=0)

    def checkpointed(layers: Any, h: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            h = ckpt.checkpoint(layer, h)
        return h

    for it in range(3):
        x = torch.randn(2, 512, 256, device=DEV, dtype=torch.bfloat16) + it
        got = models.step(stack, x, checkpointed)
        want = models.step(stack, x, models.run_plain)
        assert_same(got, want)
    stats = ckpt.stats
    assert stats.bytes_offloaded > 0 and stats.bytes_reloaded == stats.bytes_offloaded
    ckpt.close()


def test_hf_llama_decoder_layers_compiled_with_inductor_are_bitwise() -> None:
    transformers = pytest.importorskip("transformers")
    torch._dynamo.reset()
    model = _tiny_llama(transformers)
    layers = offload.find_layers(model)
    for layer in layers:
        layer.compile()
    off = offload.ActivationOffloader(layers, offload_layers="all", min_tensor_bytes=0)
    for _ in range(2):
        ids = torch.randint(0, 512, (2, 256), device=DEV)
        results = []
        for entered in (True, False):
            model.zero_grad(set_to_none=True)
            with off if entered else models.contextlib.nullcontext():
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        (loss, grads), (want, want_grads) = results
        assert torch.equal(loss, want)
        assert all(torch.equal(a, b) for a, b in zip(grads, want_grads, strict=True))
        assert [la.bytes_offloaded > 0 for la in off.stats.layers] == [True, True, True, False]
    off.close()
