"""Sequence-tiled MLP recompute: ``offload.tile_mlp``.

Loss and every gradient against the plain model (fp32 element-wise within rtol 1e-5 /
atol 1e-6; bf16 within 2 % of the reference's largest magnitude), tile sizes that do
and do not divide the sequence, frozen weights and LoRA adapters inside the MLP, a
dropout replayed in the backward, ``remove()``, composition with the head lever,
``ActivationOffloader`` and ``offload_checkpointing``, and the errors. The CUDA twin
checks the peak memory.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import offload
from tests.hf_tiny import assert_close, assert_grads_close, batch, step, tiny_llama


def _mlp(drop: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Dropout(drop), nn.GELU(), nn.Linear(32, 8))


def _grads(module: nn.Module, x: torch.Tensor, out: torch.Tensor) -> list:
    out.square().sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in module.parameters() if p.requires_grad]
    x.grad = None
    module.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("tile_tokens", [1, 16, 30, 100, "auto"])
@pytest.mark.parametrize("frozen", [False, True])
def test_module_matches_plain_fp32(tile_tokens, frozen) -> None:
    mlp = _mlp()
    if frozen:
        mlp[0].weight.requires_grad_(False)
    x = torch.randn(2, 90, 8, requires_grad=True)
    want_out = mlp(x)
    want = _grads(mlp, x, want_out)
    handle = offload.tile_mlp([mlp], tile_tokens=tile_tokens)
    out = mlp(x)
    got = _grads(mlp, x, out)
    assert_close(out.detach(), want_out.detach(), what="output")
    for i, (a, e) in enumerate(zip(got, want)):
        assert_close(a, e, what=f"grad {i}")
    if frozen:
        assert mlp[0].weight.grad is None
    tiled = tile_tokens not in (100, "auto")  # "auto" tiles are >= 1024 tokens
    assert handle.calls == int(tiled)
    handle.remove()


def test_dropout_masks_replayed_in_the_backward() -> None:
    """The backward's tiles draw the masks the forward's drew: the gradients equal
    those of the same tiles run with autograd from the same seed."""
    mlp = _mlp(drop=0.3)
    x = torch.randn(2, 50, 8, requires_grad=True)
    torch.manual_seed(7)
    want_out = torch.cat([mlp(part) for part in x.split(16, 1)], 1)
    want = _grads(mlp, x, want_out)
    offload.tile_mlp([mlp], tile_tokens=16)
    torch.manual_seed(7)
    out = mlp(x)
    got = _grads(mlp, x, out)
    assert torch.equal(out.detach(), want_out.detach())
    for i, (a, e) in enumerate(zip(got, want)):
        assert_close(a, e, what=f"grad {i}")


def test_input_without_grad_and_no_grad_mode() -> None:
    mlp = _mlp()
    x = torch.randn(1, 40, 8)
    want = mlp(x)
    offload.tile_mlp([mlp], tile_tokens=7)
    out = mlp(x)  # only the parameters need gradients
    out.sum().backward()
    assert all(p.grad is not None for p in mlp.parameters())
    with torch.no_grad():
        assert_close(mlp(x), want.detach(), what="no-grad output")


def test_other_calls_run_unchanged() -> None:
    calls = []

    class TwoArgs(nn.Module):
        def forward(self, x, scale=1.0):
            calls.append(x.shape)
            return x * scale

    module = TwoArgs()
    offload.tile_mlp([module], tile_tokens=4)
    module(torch.ones(1, 10, 3), scale=2.0)  # a keyword: not tiled
    assert calls == [(1, 10, 3)]
    module(torch.ones(10))  # one dimension: not tiled
    module(torch.ones(1, 10, 3))
    assert calls[-3:] == [(1, 4, 3), (1, 4, 3), (1, 2, 3)]


def test_module_returning_a_tuple_raises() -> None:
    class Pair(nn.Module):
        def forward(self, x):
            return x, x.sum()

    module = Pair()
    offload.tile_mlp([module], tile_tokens=4)
    with pytest.raises(TypeError, match="returns one tensor; Pair returned tuple"):
        module(torch.ones(1, 10, 3, requires_grad=True))


def test_errors_name_the_argument() -> None:
    mlp = _mlp()
    for bad in (0, -1, True, 2.5, "half"):
        with pytest.raises(ValueError, match=r"tile_tokens.*positive int.*'auto'"):
            offload.tile_mlp([mlp], tile_tokens=bad)
    with pytest.raises(TypeError, match="model_or_modules"):
        offload.tile_mlp(3)
    with pytest.raises(ValueError, match="no modules"):
        offload.tile_mlp([])
    handle = offload.tile_mlp([mlp])
    with pytest.raises(ValueError, match="tiled already"):
        offload.tile_mlp([mlp])
    handle.remove()
    assert "forward" not in vars(mlp)


# ---- Hugging Face models ---------------------------------------------------------------

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("tile_tokens", [5, 16, 37])
def test_hf_llama_fp32(tile_tokens) -> None:
    plain = tiny_llama()
    model = copy.deepcopy(plain)
    ids, labels = batch(96)
    want_loss, want, _ = step(plain, ids, labels)
    handle = offload.tile_mlp(model, tile_tokens=tile_tokens)
    assert handle.modules == [layer.mlp for layer in model.model.layers]
    loss, got, _ = step(model, ids, labels)
    assert_close(loss, want_loss, what="loss")
    assert_grads_close(got, want)
    assert handle.calls == (0 if tile_tokens == 37 else 2)
    handle.remove()
    loss, again, _ = step(model, ids, labels)
    assert torch.equal(loss, want_loss) and all(torch.equal(again[k], want[k]) for k in want)


def test_hf_mixtral_moe_block() -> None:
    """Mixtral's sparse MoE block routes each token on its own: tiling it is exact too
    (batch 2: its tiles are strided views, made contiguous for its .view())."""
    config = transformers.MixtralConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        use_cache=False,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    plain = transformers.MixtralForCausalLM(config).train()
    model = copy.deepcopy(plain)
    ids, labels = batch(96)
    want_loss, want, _ = step(plain, ids, labels)
    handle = offload.tile_mlp(model, tile_tokens=8)
    loss, got, _ = step(model, ids, labels)
    assert handle.calls == 2
    assert_close(loss, want_loss, what="loss")
    assert_grads_close(got, want)


def test_hf_llama_bf16() -> None:
    plain = tiny_llama(dtype=torch.bfloat16)
    model = copy.deepcopy(plain)
    ids, labels = batch(96)
    want_loss, want, _ = step(plain, ids, labels)
    offload.tile_mlp(model, tile_tokens=8)
    loss, got, _ = step(model, ids, labels)
    assert_close(loss, want_loss, bf16=True, what="loss")
    assert_grads_close(got, want, bf16=True)


@pytest.mark.parametrize("compose", ["head", "offloader", "checkpointing"])
def test_hf_llama_composes(compose) -> None:
    from offload.integrations.hf import offload_checkpointing

    plain = tiny_llama(layers=3)
    model = copy.deepcopy(plain)
    ids, labels = batch(96, seq=48)
    want_loss, want, _ = step(plain, ids, labels)
    tiles = offload.tile_mlp(model, tile_tokens=10)
    head = offload.sliced_head_loss(model, slice_tokens=17)
    if compose == "checkpointing":
        ckpt = offload_checkpointing(model)
        loss, got, _ = step(model, ids, labels)
        ckpt.remove()
    elif compose == "offloader":
        offloader = offload.ActivationOffloader(
            offload.find_layers(model), offload_layers="all", min_tensor_bytes=0
        )
        with offloader:
            out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        loss, got = out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}
        assert offloader.stats.bytes_offloaded > 0
        offloader.close()
    else:
        loss, got, _ = step(model, ids, labels)
    assert_close(loss, want_loss, what="loss")
    assert_grads_close(got, want)
    assert tiles.calls >= 3
    head.remove()
    tiles.remove()


@pytest.mark.parametrize("checkpointing", ["torch", "offload", "hf", "hf-ours"])
def test_checkpointed_layer_runs_the_mlp_twice_not_three_times(checkpointing) -> None:
    """Note [tiled input first]: under a non-reentrant checkpoint of a layer ending in its
    MLP, the recomputation stops at the tiled call's input, so each tile of each layer
    runs once in the forward and once in the backward; gradients as the plain model's."""
    from offload.integrations.hf import offload_checkpointing

    plain = tiny_llama(layers=3)
    model = copy.deepcopy(plain)
    ids, labels = batch(96, seq=48)
    want_loss, want, _ = step(plain, ids, labels)
    runs = []
    for i, layer in enumerate(offload.find_layers(model)):
        inner = layer.mlp.forward
        layer.mlp.forward = lambda x, _i=i, _f=inner: (runs.append(_i), _f(x))[1]
    tiles = offload.tile_mlp(model, tile_tokens=10)  # 48 tokens: 5 tiles a call
    undo = None
    if checkpointing in ("hf", "hf-ours"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        undo = offload_checkpointing(model) if checkpointing == "hf-ours" else None
    else:
        fn = offload.checkpoint if checkpointing == "offload" else torch.utils.checkpoint.checkpoint
        for layer in offload.find_layers(model):
            call = layer.forward
            layer.forward = lambda *a, _c=call, **k: fn(_c, *a, use_reentrant=False, **k)
    loss, got, _ = step(model, ids, labels)
    assert sorted(runs) == sorted([0, 1, 2] * 10), runs  # 5 tiles forward, 5 backward
    assert_close(loss, want_loss, what="loss")
    assert_grads_close(got, want)
    if undo is not None:
        undo.remove()
    tiles.remove()


def test_hf_peft_lora_in_the_mlp() -> None:
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "up_proj", "down_proj"], lora_dropout=0.0
    )
    plain = peft.get_peft_model(tiny_llama(), lora)
    torch.manual_seed(3)
    for p in plain.parameters():
        if p.requires_grad:
            p.data.normal_(0, 0.1)
    model = copy.deepcopy(plain)
    ids, labels = batch(96)
    want_loss, want, _ = step(plain, ids, labels)
    handle = offload.tile_mlp(model, tile_tokens=9)
    assert len(handle.modules) == 2
    loss, got, _ = step(model, ids, labels)
    assert any("mlp.up_proj.lora_A" in name for name in got)
    assert all("lora_" in name for name in got)
    assert_close(loss, want_loss, what="loss")
    assert_grads_close(got, want)


def test_hf_mlp_intermediates_one_tile_at_a_time() -> None:
    """No tensor of the step holds more than one tile of MLP intermediates (ffn wide)."""
    from tests.recompute.test_head_loss import _LargestWithLastDim

    plain = tiny_llama(ffn=72)
    model = copy.deepcopy(plain)
    ids, labels = batch(96, seq=64, size=1)
    with _LargestWithLastDim(72) as seen:
        step(plain, ids, labels)
    assert seen.most == 64 * 72
    # 40 positions a tile: more than the down projection's weight (hidden 32 x ffn)
    offload.tile_mlp(model, tile_tokens=40)
    with _LargestWithLastDim(72) as seen:
        step(model, ids, labels)
    assert seen.most == 40 * 72


# ---- CUDA ------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_checkpointed_layer_peak_drops() -> None:
    """bf16, ffn 8192, 8192 tokens under checkpointing: the recomputed layer's MLP
    intermediates (3 x 8192 x 8192 x 2 bytes = 384 MiB) shrink to a tile's."""
    from offload.integrations.hf import offload_checkpointing

    plain = tiny_llama(
        vocab=512, hidden=256, ffn=8192, layers=2, dtype=torch.bfloat16, device="cuda", attn="sdpa"
    )
    model = copy.deepcopy(plain)
    ids, labels = batch(512, seq=8192, size=1, device="cuda")

    def measured(m):
        step(m, ids, labels)  # warm-up
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss, grads, _ = step(m, ids, labels)
        torch.cuda.synchronize()
        return loss, grads, torch.cuda.max_memory_allocated() - before

    offload_checkpointing(plain)
    want_loss, want, plain_peak = measured(plain)
    offload_checkpointing(model)
    offload.tile_mlp(model, tile_tokens=1024)
    loss, got, peak = measured(model)
    assert peak < plain_peak - 128 * 2**20, (peak / 2**20, plain_peak / 2**20)
    assert_close(loss, want_loss, bf16=True, what="loss")
    assert_grads_close(got, want, bf16=True)
