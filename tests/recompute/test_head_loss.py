"""The LM head and loss in slices: ``offload.sliced_cross_entropy`` and
``offload.sliced_head_loss``.

Loss and gradients against the plain computation (``F.cross_entropy`` on full fp32
logits; a plain Hugging Face ``LlamaForCausalLM``): fp32 element-wise within rtol 1e-5 /
atol 1e-6, bf16 within 2 % of the reference's largest magnitude (``tests/hf_tiny.py``).
Covers ignored labels, ``num_items_in_batch``, slice sizes that do and do not divide the
length, a frozen or trainable head, softcapping, PEFT LoRA, ``remove()``, composition
with ``ActivationOffloader`` and ``offload_checkpointing``, and the errors. The CUDA
twin checks that the peak memory drops.
"""

from __future__ import annotations

import copy
import gc
import importlib.util
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import offload
from offload._recompute._head import auto_slice_tokens
from tests.hf_tiny import assert_close, assert_grads_close, batch, step, tiny_llama

# ---- the functional form ---------------------------------------------------------------


def _plain_ce(h, w, b, y, *, softcap=None, num_items=None, shift=False):
    z = F.linear(h, w, b).float()
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    if shift:
        y = F.pad(y, (0, 1), value=-100)[..., 1:]
    z, y = z.flatten(0, -2), y.flatten()
    if num_items is not None:
        return F.cross_entropy(z, y, reduction="sum") / num_items
    return F.cross_entropy(z, y)


def _leaves(dtype=torch.float32, *, bias=True, weight_grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(3, 11, 16, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(40, 16, generator=g) * 0.5).to(dtype).requires_grad_(weight_grad)
    b = (torch.randn(40, generator=g) * 0.1).to(dtype).requires_grad_() if bias else None
    y = torch.randint(0, 40, (3, 11), generator=g)
    y[0, :4] = -100
    return h, w, b, y


def _grads(loss, tensors, factor=1.0):
    (loss * factor).backward()
    out = [None if t is None or t.grad is None else t.grad.clone() for t in tensors]
    for t in tensors:
        if t is not None:
            t.grad = None
    return out


@pytest.mark.parametrize("slice_tokens", [1, 5, 8, 33, 1000, "auto"])
@pytest.mark.parametrize(
    "case", ["mean", "sum", "num_items", "shift", "softcap", "no_bias", "frozen_head"]
)
def test_functional_matches_cross_entropy_fp32(slice_tokens, case) -> None:
    h, w, b, y = _leaves(bias=case != "no_bias", weight_grad=case != "frozen_head")
    kw = {
        "sum": {"reduction": "sum"},
        "num_items": {"num_items_in_batch": torch.tensor(17)},
        "shift": {"shift": True},
        "softcap": {"softcap": 2.5},
    }.get(case, {})
    ours = offload.sliced_cross_entropy(h, w, y, b, slice_tokens=slice_tokens, **kw)
    got = _grads(ours, (h, w, b), factor=0.7)  # a grad_output other than 1
    if case == "sum":
        ref = F.cross_entropy(F.linear(h, w, b).float().flatten(0, 1), y.flatten(), reduction="sum")
    else:
        ref = _plain_ce(
            h,
            w,
            b,
            y,
            softcap=kw.get("softcap"),
            num_items=17 if case == "num_items" else None,
            shift=case == "shift",
        )
    want = _grads(ref, (h, w, b), factor=0.7)
    assert ours.dtype == torch.float32 and ours.dim() == 0
    assert_close(ours, ref.detach(), what="loss")
    for name, a, e in zip(("hidden", "weight", "bias"), got, want):
        assert (a is None) == (e is None), name
        if a is not None:
            assert_close(a, e, what=name)
    if case == "frozen_head":
        assert w.grad is None


def test_functional_bf16_within_tolerance() -> None:
    h, w, b, y = _leaves(torch.bfloat16)
    ours = offload.sliced_cross_entropy(h, w, y, b, slice_tokens=7)
    got = _grads(ours, (h, w, b))
    ref = _plain_ce(h, w, b, y)
    want = _grads(ref, (h, w, b))
    assert_close(ours, ref.detach(), bf16=True, what="loss")
    for name, a, e in zip(("hidden", "weight", "bias"), got, want):
        assert a.dtype == torch.bfloat16, name
        assert_close(a, e, bf16=True, what=name)


def test_functional_under_autocast_matches_linear_under_autocast() -> None:
    h, w, b, y = _leaves()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = offload.sliced_cross_entropy(h, w, y, b, slice_tokens=6)
        ref = _plain_ce(h, w, b, y)
    got, want = _grads(ours, (h, w, b)), _grads(ref, (h, w, b))
    assert_close(ours, ref.detach(), bf16=True, what="loss")
    for name, a, e in zip(("hidden", "weight", "bias"), got, want):
        assert a.dtype == torch.float32, name  # gradients in the leaves' dtype
        assert_close(a, e, bf16=True, what=name)


def test_functional_without_grad_builds_no_graph() -> None:
    h, w, b, y = _leaves()
    with torch.no_grad():
        loss = offload.sliced_cross_entropy(h, w, y, b, slice_tokens=4)
    assert loss.grad_fn is None
    assert_close(loss, _plain_ce(h, w, b, y).detach(), what="loss")


def test_functional_gradients_released_by_the_backward_while_the_loss_lives() -> None:
    """Note [head slice buffers]: the gradients formed in the forward are autograd's saved
    tensors, freed by the backward that used them, not kept as long as the loss."""
    h, w, b, y = _leaves()
    loss = offload.sliced_cross_entropy(h, w, y, b, slice_tokens=4)
    saved = [weakref.ref(t) for t in loss.grad_fn.saved_tensors if t is not None]
    assert len(saved) == 3  # hidden's, weight's and bias's gradients
    loss.backward()
    gc.collect()
    assert [r() for r in saved] == [None, None, None]
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()


def test_functional_retain_graph_backward_twice_doubles() -> None:
    h, w, b, y = _leaves()
    loss = offload.sliced_cross_entropy(h, w, y, b, slice_tokens=4)
    loss.backward(retain_graph=True)
    once = [t.grad.clone() for t in (h, w, b)]
    loss.backward()
    for t, g in zip((h, w, b), once):
        assert torch.equal(t.grad, g * 2)


def test_auto_slice_tokens() -> None:
    assert auto_slice_tokens(32000) == 4096
    assert auto_slice_tokens(128256) == 1024
    assert auto_slice_tokens(10) == 8192 and auto_slice_tokens(10**7) == 256


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"slice_tokens": 0}, ["slice_tokens", "'auto'"]),
        ({"slice_tokens": True}, ["slice_tokens"]),
        ({"slice_tokens": "big"}, ["slice_tokens", "'auto'"]),
        ({"reduction": "none"}, ["reduction", "'mean'", "'sum'"]),
        ({"backend": "triton"}, ["backend", "'torch'", "'liger'"]),
        ({"softcap": -1.0}, ["softcap"]),
    ],
)
def test_functional_bad_arguments_name_the_argument(kwargs, names) -> None:
    h, w, b, y = _leaves()
    with pytest.raises(ValueError) as err:
        offload.sliced_cross_entropy(h, w, y, b, **kwargs)
    for name in names:
        assert name in str(err.value)


def test_functional_shape_errors() -> None:
    h, w, b, y = _leaves()
    with pytest.raises(ValueError, match="labels"):
        offload.sliced_cross_entropy(h, w, y[:, :-1], b)
    with pytest.raises(ValueError, match="weight"):
        offload.sliced_cross_entropy(h, w[:, :-1], y, b)


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is not None, reason="liger installed")
def test_liger_backend_without_liger_raises_import_error() -> None:
    h, w, b, y = _leaves()
    with pytest.raises(ImportError, match="liger-kernel"):
        offload.sliced_cross_entropy(h, w, y, b, backend="liger")
    pytest.importorskip("transformers")
    with pytest.raises(ImportError, match="liger-kernel"):
        offload.sliced_head_loss(tiny_llama(), backend="liger")


# ---- Hugging Face models ---------------------------------------------------------------

transformers = pytest.importorskip("transformers")


def _pair(**kwargs):
    model = tiny_llama(**kwargs)
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("slice_tokens", [1, 16, 23, "auto"])
def test_hf_llama_loss_and_every_gradient_fp32(slice_tokens) -> None:
    plain, model = _pair()
    ids, labels = batch(96)
    want_loss, want, _ = step(plain, ids, labels)
    handle = offload.sliced_head_loss(model, slice_tokens=slice_tokens)
    loss, got, out = step(model, ids, labels)
    assert out.logits is None and "logits" not in out
    assert_close(loss, want_loss, what="loss")
    assert_grads_close(got, want)
    assert handle.calls == 1 and handle.model is model


def test_hf_llama_num_items_in_batch() -> None:
    plain, model = _pair()
    ids, labels = batch(96)
    n = torch.tensor(100)  # what Trainer passes: the tokens of all accumulated batches
    want_loss, want, _ = step(plain, ids, labels, num_items_in_batch=n)
    offload.sliced_head_loss(model, slice_tokens=9)
    loss, got, _ = step(model, ids, labels, num_items_in_batch=n)
    assert_close(loss, want_loss, what="loss")
    assert_grads_close(got, want)


def test_hf_llama_shift_labels_and_tied_head() -> None:
    plain, model = _pair()
    plain.lm_head.weight = plain.model.embed_tokens.weight  # tied, as small models do
    model.lm_head.weight = model.model.embed_tokens.weight
    ids, labels = batch(96)
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    want_loss, want, _ = step(plain, ids, labels, shift_labels=shifted)
    offload.sliced_head_loss(model, slice_tokens=10)
    loss, got, _ = step(model, ids, labels, shift_labels=shifted)
    assert_close(loss, want_loss, what="loss")
    assert_grads_close(got, want)


def test_hf_llama_bf16() -> None:
    plain, model = _pair(dtype=torch.bfloat16)
    ids, labels = batch(96)
    want_loss, want, _ = step(plain, ids, labels)
    offload.sliced_head_loss(model, slice_tokens=13)
    loss, got, _ = step(model, ids, labels)
    assert_close(loss, want_loss, bf16=True, what="loss")
    assert_grads_close(got, want, bf16=True)


def test_hf_frozen_head_gets_no_gradient() -> None:
    plain, model = _pair()
    for m in (plain, model):
        m.lm_head.weight.requires_grad_(False)
    ids, labels = batch(96)
    want_loss, want, _ = step(plain, ids, labels)
    offload.sliced_head_loss(model, slice_tokens=8)
    loss, got, _ = step(model, ids, labels)
    assert "lm_head.weight" not in got
    assert_close(loss, want_loss, what="loss")
    assert_grads_close(got, want)


def test_hf_without_labels_and_after_remove_as_before() -> None:
    plain, model = _pair()
    ids, labels = batch(96)
    handle = offload.sliced_head_loss(model, slice_tokens=8)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=0, atol=0)
        sliced = model(ids, labels=labels).loss
    assert_close(sliced, plain(ids, labels=labels).loss.detach(), what="no-grad loss")
    assert "forward" in vars(model) and "_loss_function" in vars(model)
    handle.remove()
    handle.remove()  # idempotent
    assert "forward" not in vars(model) and "forward" not in vars(model.lm_head)
    assert "_loss_function" not in vars(model)
    want_loss, want, want_out = step(plain, ids, labels)
    loss, got, out = step(model, ids, labels)
    assert torch.equal(loss, want_loss) and torch.equal(out.logits, want_out.logits)
    assert all(torch.equal(got[k], want[k]) for k in want)
    with offload.sliced_head_loss(model) as again:  # installs again after remove
        assert not again.removed
    assert again.removed and "forward" not in vars(model)


def test_hf_with_activation_offloader() -> None:
    plain, model = _pair(layers=3)
    ids, labels = batch(96)
    want_loss, want, _ = step(plain, ids, labels)
    offload.sliced_head_loss(model, slice_tokens=12)
    offloader = offload.ActivationOffloader(
        offload.find_layers(model), offload_layers="all", min_tensor_bytes=0
    )
    with offloader:
        out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    got = {n: p.grad for n, p in model.named_parameters()}
    assert offloader.stats.bytes_offloaded > 0
    assert_close(out.loss.detach(), want_loss, what="loss")
    assert_grads_close(got, want)
    offloader.close()


def test_hf_with_offload_checkpointing() -> None:
    from offload.integrations.hf import offload_checkpointing

    plain, model = _pair(layers=3)
    ids, labels = batch(96, seq=64)
    want_loss, want, _ = step(plain, ids, labels)
    ckpt = offload_checkpointing(model)
    head = offload.sliced_head_loss(model, slice_tokens=20)
    loss, got, _ = step(model, ids, labels)
    assert_close(loss, want_loss, what="loss")
    assert_grads_close(got, want)
    head.remove()
    ckpt.remove()


def test_hf_peft_lora() -> None:
    peft = pytest.importorskip("peft")
    base = tiny_llama()
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    plain = peft.get_peft_model(copy.deepcopy(base), lora)
    torch.manual_seed(3)  # LoRA B starts at zero: give it values so every path is used
    for p in plain.parameters():
        if p.requires_grad:
            p.data.normal_(0, 0.1)
    model = copy.deepcopy(plain)
    ids, labels = batch(96)
    want_loss, want, _ = step(plain, ids, labels)
    handle = offload.sliced_head_loss(model, slice_tokens=11)
    assert type(handle.model).__name__ == "LlamaForCausalLM"
    loss, got, out = step(model, ids, labels)
    assert out.logits is None and handle.calls == 1
    assert got and all("lora_" in name for name in got)
    assert_close(loss, want_loss, what="loss")
    assert_grads_close(got, want)


def test_hf_gemma2_softcap() -> None:
    config = transformers.Gemma2Config(
        vocab_size=80,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        final_logit_softcapping=4.0,
        use_cache=False,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    plain = transformers.Gemma2ForCausalLM(config).train()
    model = copy.deepcopy(plain)
    ids, labels = batch(80)
    want_loss, want, _ = step(plain, ids, labels)
    handle = offload.sliced_head_loss(model, slice_tokens=16)
    assert handle.softcap == 4.0
    loss, got, _ = step(model, ids, labels)
    assert_close(loss, want_loss, what="loss")
    assert_grads_close(got, want)


def test_hf_errors() -> None:
    model = tiny_llama()
    with pytest.raises(TypeError, match="causal LM"):
        offload.sliced_head_loss(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="slice_tokens"):
        offload.sliced_head_loss(model, slice_tokens=-3)
    with pytest.raises(ValueError, match="backend.*'torch', 'liger'"):
        offload.sliced_head_loss(model, backend="cuda")
    handle = offload.sliced_head_loss(model)
    with pytest.raises(ValueError, match="already"):
        offload.sliced_head_loss(model)
    handle.remove()
    model.lm_head = torch.nn.Sequential(model.lm_head)  # not an nn.Linear
    with pytest.raises(TypeError, match="nn.Linear"):
        offload.sliced_head_loss(model)


def test_hf_model_that_skips_loss_function_raises() -> None:
    model = tiny_llama()

    def own_loss_forward(input_ids, labels=None):  # computes no loss from the head
        hidden = model.model(input_ids=input_ids).last_hidden_state
        return transformers.modeling_outputs.CausalLMOutputWithPast(logits=model.lm_head(hidden))

    model.forward = own_loss_forward
    handle = offload.sliced_head_loss(model)
    ids, labels = batch(96)
    with pytest.raises(RuntimeError, match="loss_function"):
        model(input_ids=ids, labels=labels)
    handle.remove()
    assert model.forward is own_loss_forward  # the instance's own forward comes back


class _LargestWithLastDim(TorchDispatchMode):
    """Records the most elements of any op output whose last dimension is ``width``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width, self.most = width, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.width:
                self.most = max(self.most, t.numel())
        return out


def test_hf_never_forms_the_full_logits() -> None:
    """No tensor of the step, forward or backward, holds more than one slice of logits
    (the plain step holds all of them: 2 x 64 rows)."""
    plain, model = _pair(vocab=997)
    ids, labels = batch(997, seq=64)
    with _LargestWithLastDim(997) as seen:
        step(plain, ids, labels)
    assert seen.most == 2 * 64 * 997
    # 40 rows a slice: more than the head weight's transposed view (hidden 32 x vocab)
    offload.sliced_head_loss(model, slice_tokens=40)
    with _LargestWithLastDim(997) as seen:
        step(model, ids, labels)
    assert seen.most == 40 * 997


def test_hf_forward_signature_kept() -> None:
    """Trainer reads ``model.forward``'s signature (``**kwargs`` means it passes
    ``num_items_in_batch``): the wrapper shows the original's."""
    import inspect

    model = tiny_llama()
    before = inspect.signature(model.forward)
    handle = offload.sliced_head_loss(model)
    assert inspect.signature(model.forward) == before
    handle.remove()


def test_hf_trainer_with_gradient_accumulation(tmp_path) -> None:
    """``Trainer`` passes ``num_items_in_batch`` under gradient accumulation: two
    optimizer steps of 2 x 2 sequences with labels partly masked land on the plain
    run's weights."""
    pytest.importorskip("accelerate")
    ids, labels = batch(96, seq=24, size=8)
    data = [{"input_ids": i, "labels": y} for i, y in zip(ids, labels)]

    def train(model, name):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / name),
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_steps=2,
            optim="sgd",  # Adam would amplify rounding in near-zero gradients
            learning_rate=0.1,
            lr_scheduler_type="constant",
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
        )
        transformers.Trainer(model=model, args=args, train_dataset=data).train()
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    plain, model = _pair()
    want = train(plain, "plain")
    handle = offload.sliced_head_loss(model, slice_tokens=10)
    got = train(model, "sliced")
    assert handle.calls == 4
    assert_grads_close(got, want)


# ---- CUDA ------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_peak_drops_and_gradients_match() -> None:
    """bf16, vocab 32000, 4096 tokens: the plain step holds the fp32 logits (500 MiB)
    and their gradient; the sliced one a slice at a time."""
    plain = tiny_llama(
        vocab=32000, hidden=256, ffn=512, layers=2, dtype=torch.bfloat16, device="cuda", attn="sdpa"
    )
    model = copy.deepcopy(plain)
    ids, labels = batch(32000, seq=4096, size=1, device="cuda")

    def measured(m):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss, grads, _ = step(m, ids, labels)
        torch.cuda.synchronize()
        return loss, grads, torch.cuda.max_memory_allocated() - before

    step(plain, ids, labels)  # warm-up: cuBLAS workspaces
    want_loss, want, plain_peak = measured(plain)
    offload.sliced_head_loss(model, slice_tokens=1024)
    step(model, ids, labels)
    loss, got, peak = measured(model)
    assert peak < plain_peak - 256 * 2**20, (peak / 2**20, plain_peak / 2**20)
    assert_close(loss, want_loss, bf16=True, what="loss")
    assert_grads_close(got, want, bf16=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="needs liger-kernel")
def test_cuda_liger_backend_matches() -> None:
    plain = tiny_llama(vocab=4096, hidden=128, ffn=256, dtype=torch.bfloat16, device="cuda")
    model = copy.deepcopy(plain)
    ids, labels = batch(4096, seq=512, device="cuda")
    want_loss, want, _ = step(plain, ids, labels)
    offload.sliced_head_loss(model, backend="liger")
    loss, got, _ = step(model, ids, labels)
    assert_close(loss, want_loss, bf16=True, what="loss")
    assert_grads_close(got, want, bf16=True)
