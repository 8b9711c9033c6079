"""``ActivationOffloader.attach(model)``: the context entered by hooks on a model's forward.

Checked on CPU: a Hugging Face ``Trainer`` run and a plain ``nn.Module`` stack train
bitwise equal to the same run without offloading while bytes are offloaded; ``remove()``
and ``detach()`` leave no hook behind and nothing is offloaded afterwards; a forward
that raises leaves no saved-tensor hook on the thread and no host memory in use;
attaching twice raises; an already-entered offloader, nested calls of the model,
no-grad forwards and a forward run inside an ``except`` block are handled.
"""

from __future__ import annotations

import copy
import gc
import pickle
import tempfile
from typing import Any

import pytest
import torch
from torch import nn

import offload
from tests import models

DIM = 64


class Stack(nn.Module):
    """``LlamaBlock`` layers, then a loss: ``model(x)`` returns a scalar.

    ``fail_at``: raise ``ValueError`` at the start of that layer (``len(layers)``: after
    all of them). ``recurse``: the forward calls the model again on its own output, that
    many times (a nested call of the attached module), and calls layer 0 once more after
    each nested call returned.
    """

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(models.LlamaBlock(DIM) for _ in range(n))
        self.fail_at: int | None = None
        self.recurse = 0
        self.on_forward: Any = None

    def forward(self, x: torch.Tensor, depth: int = 0) -> torch.Tensor:
        if self.on_forward is not None:
            self.on_forward()
        for i, layer in enumerate(self.layers):
            if self.fail_at == i:
                raise ValueError(f"failure in layer {i}")
            x = layer(x)
        if self.fail_at == len(self.layers):
            raise ValueError("failure after the layers")
        loss = x.float().square().mean()
        if depth < self.recurse:
            loss = loss + self(x, depth + 1)
            loss = loss + self.layers[0](x).float().square().mean()  # after the nested call
        return loss


def make() -> tuple[Stack, Stack, torch.Tensor]:
    torch.manual_seed(0)
    model = Stack()
    return model, copy.deepcopy(model), torch.randn(2, 16, DIM)


def train_step(model: nn.Module, x: torch.Tensor, **kwargs: Any) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x.clone().requires_grad_(True), **kwargs).backward()
    return [p.grad.clone() for p in model.parameters()]


def assert_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want) and got
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"gradient {i} differs: max {(a - b).abs().max()}"


def no_hooks(module: nn.Module) -> bool:
    return not any(
        m._forward_pre_hooks or m._forward_hooks or m._forward_hooks_always_called
        for m in module.modules()
    )


def assert_plain_saves() -> None:
    """A tensor saved now is saved without any saved-tensor hooks: autograd refuses a
    second pair of hooks on a saved tensor that already went through one."""
    x = torch.randn(8, requires_grad=True)
    y = x * x
    y.grad_fn._raw_saved_self.register_hooks(lambda t: t, lambda t: t)
    y.sum().backward()
    assert torch.equal(x.grad, 2 * x.detach())


# ---- (1) Hugging Face Trainer ----------------------------------------------------------


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def test_trainer_is_bitwise_equal() -> None:
    trainer_is_bitwise_equal(use_cpu=True)


def trainer_is_bitwise_equal(use_cpu: bool) -> None:
    """Two steps of ``transformers.Trainer`` on a tiny Llama, with an attached offloader
    and without: losses and parameters bitwise equal, something offloaded. Also run on a
    GPU (``use_cpu=False``) by tests/test_real_world_cuda.py."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
        attn_implementation="eager",
    )
    model = transformers.LlamaForCausalLM(config)
    ref = copy.deepcopy(model)
    start = [p.detach().clone() for p in model.parameters()]
    # "all": on a GPU "auto" may verify its choice with a step without offloading
    offloader = offload.ActivationOffloader(
        offload.find_layers(model), offload_layers="all", min_tensor_bytes=0
    )
    handle = offloader.attach(model)

    def train(m: nn.Module) -> list[dict[str, Any]]:
        with tempfile.TemporaryDirectory() as out:
            args = transformers.TrainingArguments(
                output_dir=out,
                max_steps=2,
                per_device_train_batch_size=4,
                learning_rate=1e-3,
                seed=0,
                logging_steps=1,
                report_to=[],
                use_cpu=use_cpu,
                save_strategy="no",
                disable_tqdm=True,
                dataloader_num_workers=0,
            )
            trainer = transformers.Trainer(
                model=m, args=args, train_dataset=RandomTokens(16, 32, 128)
            )
            trainer.remove_callback(transformers.PrinterCallback)
            trainer.train()
            return [log["loss"] for log in trainer.state.log_history if "loss" in log]

    ref_losses = train(ref)
    losses = train(model)
    assert losses == ref_losses and len(losses) == 2
    pairs = list(zip(model.named_parameters(), ref.named_parameters(), strict=True))
    for (name, p), (_, q) in pairs:
        assert torch.equal(p, q), f"{name} differs after 2 steps"
    assert any(not torch.equal(p.cpu(), q) for p, q in zip(model.parameters(), start))  # trained
    stats = offloader.stats
    assert stats.bytes_offloaded > 0
    assert [la.offloaded for la in stats.layers] == [True, True, False]
    assert stats.bytes_reloaded == stats.bytes_offloaded
    handle.remove()
    assert no_hooks(model)
    offloader.close()


# ---- (2) a plain stack ---------------------------------------------------------------


def test_plain_stack_is_bitwise_equal_and_offloads() -> None:
    model, ref, x = make()
    offloader = offload.ActivationOffloader(model.layers, min_tensor_bytes=1024)
    handle = offloader.attach(model)
    for it in range(3):
        xi = x + it
        model.zero_grad(set_to_none=True)
        loss = model(xi.clone().requires_grad_(True))
        models.check_released(model.layers, [0, 1, 2])  # offloaded when the forward ends
        loss.backward()
        got = [p.grad.clone() for p in model.parameters()]
        assert_equal(got, train_step(ref, xi))
        stats = offloader.stats
        assert [la.bytes_offloaded > 0 for la in stats.layers] == [True, True, True, False]
        assert stats.bytes_reloaded == stats.bytes_offloaded
        assert stats.host_pool_bytes == 0
    handle.remove()
    offloader.close()


# ---- (3) remove() and detach() ---------------------------------------------------------


def test_remove_restores_behaviour() -> None:
    model, ref, x = make()
    offloader = offload.ActivationOffloader(model.layers, min_tensor_bytes=1024)
    handle = offloader.attach(model)
    assert not no_hooks(model)
    train_step(model, x)
    before = offloader.stats.to_dict()
    assert before["bytes_offloaded"] > 0
    handle.remove()
    handle.remove()  # idempotent
    assert handle.removed
    assert no_hooks(model)
    assert not model._forward_pre_hooks and not model._forward_hooks
    model.zero_grad(set_to_none=True)
    loss = model(x.clone().requires_grad_(True))
    models.check_released(model.layers, [])  # nothing offloaded: every activation alive
    loss.backward()
    assert_equal([p.grad for p in model.parameters()], train_step(ref, x))
    assert offloader.stats.to_dict() == before  # no new forward reached the offloader
    offloader.attach(model).remove()  # attachable again after remove()
    offloader.close()


def test_handle_as_context_manager_and_detach() -> None:
    model, ref, x = make()
    other = Stack()
    offloader = offload.ActivationOffloader(model.layers, min_tensor_bytes=1024)
    with offloader.attach(model) as handle:
        assert handle.model is model
        assert_equal(train_step(model, x), train_step(ref, x))
        assert offloader.stats.bytes_offloaded > 0
    assert handle.removed and no_hooks(model)
    offloader.attach(model)
    offloader.attach(other)  # no layer of the offloader inside: it offloads nothing
    offloader.detach()
    offloader.detach()  # idempotent
    assert no_hooks(model) and no_hooks(other)
    offloader.close()


def test_copies_of_an_attached_model_are_not_attached() -> None:
    """``copy.deepcopy`` (reference and EMA models) and pickling work on an attached model;
    the copies' hooks do nothing."""
    model, ref, x = make()
    offloader = offload.ActivationOffloader(model.layers, min_tensor_bytes=1024)
    handle = offloader.attach(model)
    train_step(model, x)
    before = offloader.stats.to_dict()
    for layer in model.layers:
        layer.probe = None  # a StorageWeakRef must not be copied (its copy frees it twice)
    copies = [copy.deepcopy(model), pickle.loads(pickle.dumps(model))]
    for clone in copies:
        loss = clone(x.clone().requires_grad_(True))
        models.check_released(clone.layers, [])  # nothing of the copy was offloaded
        loss.backward()
        assert_equal([p.grad for p in clone.parameters()], train_step(ref, x))
    assert offloader.stats.to_dict() == before
    assert_equal(train_step(model, x), train_step(ref, x))  # the original still offloads
    assert offloader.stats.bytes_offloaded > 0
    handle.remove()
    offloader.close()


# ---- (4) an exception inside the forward -------------------------------------------------


@pytest.mark.parametrize("fail_at", [2, 4], ids=["inside_layer_2", "after_the_layers"])
def test_exception_frees_everything_and_leaves_no_hooks(fail_at: int) -> None:
    model, ref, x = make()
    offloader = offload.ActivationOffloader(model.layers, min_tensor_bytes=1024)
    handle = offloader.attach(model)
    train_step(model, x)  # a full step first: the pool holds slabs, none in use
    model.fail_at = fail_at
    with pytest.raises(ValueError, match="failure") as failure:
        model(x.clone().requires_grad_(True))
    model.fail_at = None
    gc.collect()
    # The traceback keeps the failed forward's frames, hence its partial graph, alive:
    # the host blocks went back to the pool anyway (the context was left with the error)
    assert failure.traceback and offloader.stats.host_pool_bytes == 0
    del failure
    gc.collect()
    stats = offloader.stats.to_dict()
    assert stats["bytes_offloaded"] > 0  # the failed forward had offloaded groups
    assert stats["host_pool_bytes"] == 0
    # while attached, each layer keeps the offloader's two hooks (inert between forwards:
    # the remove() below takes them off)
    assert all(len(m._forward_pre_hooks) == len(m._forward_hooks) == 1 for m in model.layers)
    assert_plain_saves()  # no saved-tensor hook is left on the thread
    assert offloader.stats.to_dict() == stats  # the saves above reached no offloader
    # a fresh `with offloader:` works, and so does the attachment
    model.zero_grad(set_to_none=True)
    with offloader:
        loss = model(x.clone().requires_grad_(True))
    loss.backward()
    assert offloader.stats.bytes_offloaded > 0
    assert_equal([p.grad for p in model.parameters()], train_step(ref, x))
    assert_equal(train_step(model, x), train_step(ref, x))
    assert offloader.stats.bytes_offloaded > 0 and offloader.stats.host_pool_bytes == 0
    handle.remove()
    assert no_hooks(model)
    offloader.close()


def test_forward_inside_an_except_block_is_not_aborted() -> None:
    """A forward run while the caller handles an exception (``sys.exc_info()`` is set
    during the whole call) returns normally: the context is left without error."""
    model, ref, x = make()
    offloader = offload.ActivationOffloader(model.layers, min_tensor_bytes=1024)
    handle = offloader.attach(model)
    try:
        raise KeyError("handled by the caller")
    except KeyError:
        got = train_step(model, x)
    assert_equal(got, train_step(ref, x))
    assert offloader.stats.bytes_offloaded > 0
    assert offloader.stats.bytes_reloaded == offloader.stats.bytes_offloaded
    handle.remove()
    offloader.close()


def test_remove_during_the_forward_leaves_the_context() -> None:
    model, _, x = make()
    offloader = offload.ActivationOffloader(model.layers, min_tensor_bytes=1024)
    handle = offloader.attach(model)
    model.on_forward = handle.remove
    loss = model(x.clone().requires_grad_(True))
    model.on_forward = None
    assert no_hooks(model)
    assert_plain_saves()
    del loss
    gc.collect()
    assert offloader.stats.host_pool_bytes == 0
    with offloader:  # the offloader is free again
        pass
    offloader.close()


def test_remove_after_keyboard_interrupt_leaves_the_context() -> None:
    """Module hooks never see a ``BaseException``: ``remove()`` cleans up after one."""
    model, _, x = make()
    offloader = offload.ActivationOffloader(model.layers, min_tensor_bytes=1024)
    handle = offloader.attach(model)

    def interrupt() -> None:
        raise KeyboardInterrupt

    model.layers[2].register_forward_pre_hook(lambda m, a: interrupt())
    with pytest.raises(KeyboardInterrupt):
        model(x.clone().requires_grad_(True))
    handle.remove()
    gc.collect()
    assert_plain_saves()
    assert offloader.stats.bytes_offloaded > 0 and offloader.stats.host_pool_bytes == 0
    with offloader:  # the offloader is free again
        pass
    offloader.close()


# ---- (5) double attach ---------------------------------------------------------------


def test_double_attach_raises() -> None:
    model, _, _ = make()
    offloader = offload.ActivationOffloader(model.layers)
    handle = offloader.attach(model)
    with pytest.raises(ValueError, match="already attached"):
        offloader.attach(model)
    with pytest.raises(TypeError, match="nn.Module"):
        offloader.attach(list(model.layers))  # type: ignore[arg-type]
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1
    handle.remove()
    offloader.close()


# ---- (6) an offloader entered already, nested calls, no-grad forwards --------------------


@pytest.mark.parametrize("order", ["attach_inside_with", "with_after_attach"])
def test_already_entered_offloader_is_not_entered_again(order: str) -> None:
    model, ref, x = make()
    offloader = offload.ActivationOffloader(model.layers, min_tensor_bytes=1024)
    model.zero_grad(set_to_none=True)
    handle = offloader.attach(model) if order == "with_after_attach" else None
    with offloader:
        if handle is None:
            handle = offloader.attach(model)
        loss = model(x.clone().requires_grad_(True))
        loss = loss + model(x.clone().requires_grad_(True))  # a second call, same context
    loss.backward()
    got = [p.grad.clone() for p in model.parameters()]
    ref.zero_grad(set_to_none=True)
    (ref(x.clone().requires_grad_(True)) + ref(x.clone().requires_grad_(True))).backward()
    assert_equal(got, [p.grad for p in ref.parameters()])
    stats = offloader.stats
    # the second call starts a new forward in the same entry (layer 0 again after a
    # whole forward): stats describe that one, planned like the first
    assert len(stats.layers) == 4
    assert [la.offloaded for la in stats.layers] == [True, True, True, False]
    assert stats.bytes_offloaded > 0 and stats.bytes_reloaded == stats.bytes_offloaded
    handle.remove()
    offloader.close()


def test_nested_calls_of_the_model() -> None:
    model, ref, x = make()
    model.recurse = ref.recurse = 2  # model(x) calls model twice more, nested
    offloader = offload.ActivationOffloader(model.layers, min_tensor_bytes=1024)
    handle = offloader.attach(model)
    assert_equal(train_step(model, x), train_step(ref, x))
    stats = offloader.stats
    # 4 + 4 + 4 layer calls, then layer 0 once after each nested call: each time layer 0
    # runs again after a whole forward a new forward starts, so the last one is [0, 0]
    assert len(stats.layers) == 2
    assert stats.bytes_offloaded > 0 and stats.bytes_reloaded == stats.bytes_offloaded
    assert_plain_saves()  # the outermost call left the context
    assert_equal(train_step(model, x), train_step(ref, x))  # and again
    handle.remove()
    offloader.close()


def test_no_grad_forward_is_left_alone() -> None:
    model, ref, x = make()
    offloader = offload.ActivationOffloader(model.layers, min_tensor_bytes=1024)
    handle = offloader.attach(model)
    train_step(model, x)
    before = offloader.stats.to_dict()
    with torch.no_grad():
        model(x)
    with torch.inference_mode():
        model(x)
    assert offloader.stats.to_dict() == before  # the stats still describe training
    assert_equal(train_step(model, x), train_step(ref, x))
    handle.remove()
    offloader.close()
