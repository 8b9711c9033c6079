"""The full recompute of the ``checkpoint`` levers (Note [full recompute] in
``offload/_recompute/_reentrant.py``): bitwise-equal gradients with keyword arguments, any
output structure, dropout, autocast and inputs that need no gradient; its errors; and
what it saves."""

from __future__ import annotations

import pytest
import torch

from offload._planner.levers import Recompute
from offload._recompute._reentrant import NestedBackwardError, recompute


class _Block(torch.nn.Module):
    """A layer that takes tensors by keyword and in a tuple, draws dropout, and returns a
    nested structure with an integer tensor and a non-tensor."""

    def __init__(self, width: int = 16, p: float = 0.0) -> None:
        super().__init__()
        self.a = torch.nn.Linear(width, 4 * width)
        self.b = torch.nn.Linear(4 * width, width)
        self.drop = torch.nn.Dropout(p)

    def forward(self, x, *, scale=None, pair=(None, None)):
        h = self.drop(torch.nn.functional.gelu(self.a(x)))
        y = x + self.b(h) * scale
        cos, sin = pair
        y = y * cos + sin
        return y, {"index": torch.argmax(y, dim=-1), "note": "kept"}


def _run(model: torch.nn.Module, x: torch.Tensor, wrap: bool, seed: int = 0):
    torch.manual_seed(seed)
    for p in model.parameters():
        p.grad = None
    w = Recompute(model, "checkpoint", recompute="reentrant") if wrap else None
    try:
        # by keyword; needs its gradient where x does (else no argument needs one)
        scale = torch.full((1,), 0.5, requires_grad=x.requires_grad)
        pair = (torch.rand(x.shape[-1]) + 0.5, torch.rand(x.shape[-1]))
        y, extra = model(x, scale=scale, pair=pair)
        assert extra["note"] == "kept" and extra["index"].dtype == torch.int64
        assert not extra["index"].requires_grad
        y.square().sum().backward()
        after = torch.rand(3)  # the RNG after the step: the recompute leaves it as it was
    finally:
        if w is not None:
            w.remove()
    grads = [p.grad.clone() for p in model.parameters()]
    return grads + ([scale.grad] if scale.requires_grad else []), after


@pytest.mark.parametrize("needs_grad", [True, False])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_bitwise_with_keywords_nested_outputs_and_dropout(needs_grad: bool, p: float) -> None:
    torch.manual_seed(1)
    model = _Block(p=p).train()
    x = torch.randn(4, 8, 16, requires_grad=needs_grad)
    want, rng_want = _run(model, x, wrap=False)
    x_grad = None if x.grad is None else x.grad.clone()
    x.grad = None
    got, rng_got = _run(model, x, wrap=True)
    # without an input that needs grad the parameters still get theirs (the anchor)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert torch.equal(rng_want, rng_got)
    if needs_grad:
        assert torch.equal(x_grad, x.grad)


def test_bitwise_under_autocast() -> None:
    torch.manual_seed(2)
    model = _Block()
    x = torch.randn(4, 8, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, _ = _run(model, x, wrap=False)
        got, _ = _run(model, x, wrap=True)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_forward_keeps_no_graph_and_saves_only_the_positional_arguments() -> None:
    """What the call saves goes through the saved-tensor hooks: its positional tensor
    arguments (so an offloader sends what the recompute needs), nothing of the layer's
    inside; tensors passed by keyword are held, as torch's checkpoint holds them."""
    model = _Block()
    x = torch.randn(4, 8, 16, requires_grad=True)
    scale, cos, sin = torch.ones(1), torch.ones(16), torch.zeros(16)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, _ = recompute(model.forward, "_Block", x, scale=scale, pair=(cos, sin))
    assert [id(t) for t in saved] == [id(x)]
    assert type(y.grad_fn).__name__ == "_RecomputeBackward"
    y.sum().backward()
    assert model.a.weight.grad is not None


def test_in_place_change_of_an_argument_is_caught() -> None:
    model = _Block()
    x = torch.randn(4, 8, 16, requires_grad=True)
    h = x * 1.0
    y, _ = recompute(
        model.forward, "_Block", h, scale=torch.ones(1), pair=(torch.ones(16), torch.zeros(16))
    )
    h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_autograd_grad_raises_naming_the_lever() -> None:
    model = _Block()
    x = torch.randn(4, 8, 16, requires_grad=True)
    y, _ = recompute(
        model.forward, "_Block", x, scale=torch.ones(1), pair=(torch.ones(16), torch.zeros(16))
    )
    with pytest.raises(
        NestedBackwardError, match="'checkpoint'.*loss.backward.*recompute='non_reentrant'"
    ):
        torch.autograd.grad(y.sum(), [x])


def test_autograd_grad_of_the_parameters_never_runs_the_recompute() -> None:
    """The limit offload.plan checks for (Note [full recompute], 3): asked only for the
    layer's parameters, autograd never runs the recompute's backward, and they get no
    gradient, as under torch's reentrant checkpoint."""
    model = _Block()
    x = torch.randn(4, 8, 16)
    y, _ = recompute(
        model.forward, "_Block", x, scale=torch.ones(1), pair=(torch.ones(16), torch.zeros(16))
    )
    got = torch.autograd.grad(y.sum(), list(model.parameters()), allow_unused=True)
    assert all(g is None for g in got)


def test_without_grad_the_layer_runs_plainly() -> None:
    model = _Block()
    w = Recompute(model, "checkpoint", recompute="reentrant")
    try:
        with torch.no_grad():
            y, _ = model(
                torch.randn(2, 16), scale=torch.ones(1), pair=(torch.ones(16), torch.zeros(16))
            )
        assert y.grad_fn is None
    finally:
        w.remove()
    assert "forward" not in model.__dict__


def test_under_compile_torch_checkpoint_traces_it() -> None:
    """While ``torch.compile`` traces the layer, torch's non-reentrant checkpoint runs
    (the compiler knows it); gradients stay those of the eager step."""
    torch.manual_seed(3)
    model = _Block()
    x = torch.randn(4, 8, 16, requires_grad=True)
    want, _ = _run(model, x, wrap=False)
    model.compile(backend="aot_eager", fullgraph=False)
    try:
        got, _ = _run(model, x, wrap=True)
    finally:
        torch._dynamo.reset()
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_a_retained_graph_recomputes_at_each_backward() -> None:
    torch.manual_seed(4)
    model = _Block()
    x = torch.randn(4, 8, 16, requires_grad=True)
    kw = {"scale": torch.full((1,), 0.5), "pair": (torch.ones(16), torch.zeros(16))}
    grads = []
    for wrap in (False, True):
        for p in model.parameters():
            p.grad = None
        w = Recompute(model, "checkpoint", recompute="reentrant") if wrap else None
        y, _ = model(x, **kw)
        y.sum().backward(retain_graph=True)
        y.sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        if w is not None:
            w.remove()
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_two_threads_recompute_bitwise() -> None:
    """Each call keeps its own state: two threads training their own models at once,
    every layer call wrapped, get the gradients of the step without recompute."""
    import threading

    cases = []
    for seed in (7, 8):
        torch.manual_seed(seed)
        model = _Block().train()
        x = torch.randn(4, 8, 16, requires_grad=True)
        kw = {"scale": torch.full((1,), 0.5), "pair": (torch.rand(16) + 0.5, torch.rand(16))}
        cases.append((model, x, kw))

    def step(model, x, kw):
        for p in model.parameters():
            p.grad = None
        model(x, **kw)[0].square().sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    want = [step(*c) for c in cases]
    wrappers = [Recompute(c[0], "checkpoint", recompute="reentrant") for c in cases]
    got: list = [None, None]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(20):
                got[i] = step(*cases[i])
                assert all(torch.equal(a, b) for a, b in zip(want[i], got[i]))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for w in wrappers:
        w.remove()
    assert not errors, errors
    assert all(g is not None for g in got)


@pytest.mark.parametrize("recompute", ["non_reentrant", "reentrant"])
@pytest.mark.parametrize(
    "levers", [["checkpoint"] * 3, ["checkpoint", "keep", "selective"]], ids=["ckpt", "mixed"]
)
def test_levers_under_weight_offloading_bitwise(recompute: str, levers: list[str]) -> None:
    """The recompute runs the layer's forward without its module hooks; the weight
    offloader brings the weights back for the layer's backward, which the recompute is
    part of, by either scheme."""
    import copy

    import offload
    from offload.weights import WeightOffloader
    from tests import models

    torch.manual_seed(0)
    layers = torch.nn.ModuleList(models.LlamaBlock(32, 4, 64) for _ in range(3))
    ref = copy.deepcopy(layers)
    x = torch.randn(2, 8, 32)
    want = models.step(ref, x, models.run_plain)
    plan = offload.Plan(layers, levers, min_tensor_bytes=0, recompute=recompute).apply()
    off = WeightOffloader(layers)
    try:
        for _ in range(2):
            models.assert_same(models.step(layers, x, models.run_plain), want)
            assert off.resident_layers == []
    finally:
        off.close()
        plan.remove()


def test_hf_llama_with_frozen_embeddings_gets_every_layer_gradient() -> None:
    """Frozen embeddings (as under LoRA): no layer input needs a gradient, the layers'
    parameters still get theirs through the reentrant recompute, bitwise."""
    import copy

    transformers = pytest.importorskip("transformers")
    import offload

    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.get_input_embeddings().weight.requires_grad_(False)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 16))

    def step(m):
        for p in m.parameters():
            p.grad = None
        m(input_ids=ids, labels=ids).loss.backward()
        return [p.grad for p in m.parameters() if p.requires_grad]

    want = step(ref)
    plan = offload.Plan(offload.find_layers(model), ["checkpoint"] * 3, recompute="reentrant")
    plan.apply(model)
    try:
        got = step(model)
    finally:
        plan.remove()
    assert len(got) == len(want) and all(g is not None for g in got)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_split_and_join_give_pytree_leaves_without_garbage() -> None:
    """A call's arguments and outputs split into the leaves pytree gives, in its order,
    and join back; plain trees leave nothing for the collector (pytree's flatten leaves
    a reference cycle per call), other containers go to pytree whole."""
    import collections
    import gc

    from torch.utils import _pytree as pytree

    from offload._core._pytree import join, split

    h, m = torch.randn(2, 3), torch.ones(3)
    pair = collections.namedtuple("pair", "a b")
    trees = [
        h,
        (h,),
        {"mask": None, "pos": (h, m), "cache": "x", "n": 3, "deep": [[h], {"k": m}]},
        [h, pair(m, 1)],  # a named tuple: pytree's
        {"o": collections.OrderedDict(a=h)},
        (),
    ]
    for tree in trees:
        spec, leaves = split(tree)
        want = [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]
        assert len(leaves) == len(want) and all(a is b for a, b in zip(leaves, want))
        fresh = [t.clone() for t in leaves]
        back = join(spec, fresh)
        assert pytree.tree_structure(back) == pytree.tree_structure(tree)
        got = [x for x in pytree.tree_leaves(back) if isinstance(x, torch.Tensor)]
        assert all(a is b for a, b in zip(got, fresh))
    plain = trees[2]
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        for _ in range(50):
            join(*split(plain))
        assert len(gc.get_objects()) - before < 10
    finally:
        gc.enable()
