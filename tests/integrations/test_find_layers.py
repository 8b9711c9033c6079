"""Tests for :func:`offload.find_layers` (offload/_layers.py).

Covers: Hugging Face decoder models built from tiny random configs (no downloads),
torch's own transformer stacks, user stacks, MoE layers whose experts are an
``nn.ModuleList`` (never picked, also with a single layer), the tie-break between
several outermost candidates, the ``attr=`` override and every error.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import offload
from offload._layers import find_layers

try:
    import transformers
except ImportError:  # pragma: no cover
    transformers = None

needs_transformers = pytest.mark.skipif(transformers is None, reason="transformers not installed")


def _same(found: list[nn.Module], expected: nn.Module | list[nn.Module]) -> bool:
    """``found`` is exactly the modules of ``expected``, in order (identity, not equality)."""
    expected = list(expected)
    return len(found) == len(expected) and all(a is b for a, b in zip(found, expected, strict=True))


# ---- user models ---------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class Expert(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class MoELayer(nn.Module):
    """A Mixtral-style layer (before HF fused the experts): ``experts`` is a ModuleList."""

    def __init__(self, dim: int = 8, num_experts: int = 8) -> None:
        super().__init__()
        self.router = nn.Linear(dim, num_experts)
        self.experts = nn.ModuleList(Expert(dim) for _ in range(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = top == e
            if mask.any():
                out[mask] = expert(x[mask])
        return x + out


class MoEModel(nn.Module):
    def __init__(self, num_layers: int = 2, dim: int = 8, num_experts: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, dim)
        self.layers = nn.ModuleList(MoELayer(dim, num_experts) for _ in range(num_layers))
        self.head = nn.Linear(dim, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_sequential_of_blocks_is_the_model_itself() -> None:
    model = nn.Sequential(*(Block() for _ in range(4)))
    assert _same(find_layers(model), model)


def test_sequential_of_plain_linears() -> None:
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(3)))
    assert _same(find_layers(model), model)


def test_blocks_inside_a_mixed_sequential() -> None:
    blocks = nn.Sequential(Block(), Block(), Block())
    model = nn.Sequential(nn.Embedding(16, 8), blocks, nn.LayerNorm(8), nn.Linear(8, 16))
    assert _same(find_layers(model), blocks)


def test_sequential_of_sequentials_picks_the_outer_one() -> None:
    # each block is itself a Sequential of Linear and ReLU (mixed, not a candidate), and
    # the outer Sequential holds three of the same class: the outer one is outermost
    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)))
    assert _same(find_layers(model), model)


def test_nested_candidates_pick_the_outermost() -> None:
    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sub = nn.ModuleList(Block() for _ in range(5))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stages = nn.ModuleList(Stage() for _ in range(2))

    net = Net()
    assert _same(find_layers(net), net.stages)


def test_moe_experts_are_never_picked() -> None:
    # each experts list holds more modules (8) than the layer stack (2), and is a
    # ModuleList of >= 2 same-class modules: nesting alone excludes it
    model = MoEModel(num_layers=2, num_experts=8)
    found = find_layers(model)
    assert _same(found, model.layers)
    assert all(isinstance(m, MoELayer) for m in found)


def test_moe_with_a_single_layer_does_not_fall_back_to_its_experts() -> None:
    model = MoEModel(num_layers=1, num_experts=4)
    with pytest.raises(ValueError) as info:
        find_layers(model)
    message = str(info.value)
    assert "'layers' (ModuleList of 1: MoELayer x1; a single block" in message
    assert "experts" not in message  # never even examined
    assert _same(find_layers(model, attr="layers"), model.layers)


def test_shared_block_listed_twice() -> None:
    block = Block()
    model = nn.Sequential(block, block, block)
    found = find_layers(model)
    assert len(found) == 3 and all(m is block for m in found)


# ---- torch's transformer stacks ------------------------------------------------------


def test_transformer_encoder() -> None:
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32)
    model = nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False)
    found = find_layers(model)
    assert _same(found, model.layers)
    assert all(isinstance(m, nn.TransformerEncoderLayer) for m in found)


def test_transformer_encoder_inside_a_model() -> None:
    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(32, 16)
            layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))

    model = Classifier()
    assert _same(find_layers(model), model.encoder.layers)


def test_tie_break_most_parameters_wins() -> None:
    # nn.Transformer: encoder.layers and decoder.layers are both outermost candidates of
    # the same length; a decoder layer also has cross-attention, so it has more parameters
    model = nn.Transformer(
        d_model=16,
        nhead=2,
        num_encoder_layers=2,
        num_decoder_layers=2,
        dim_feedforward=32,
        batch_first=True,
    )
    assert _num_params(model.decoder.layers) > _num_params(model.encoder.layers)
    assert _same(find_layers(model), model.decoder.layers)


def test_tie_break_more_parameters_beats_more_blocks() -> None:
    class TwoStacks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.small = nn.ModuleList(nn.Linear(2, 2) for _ in range(6))
            self.big = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))

    model = TwoStacks()
    assert _same(find_layers(model), model.big)


def test_tie_break_equal_parameters_first_registered_wins() -> None:
    class Twins(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.ModuleList(Block() for _ in range(2))
            self.second = nn.ModuleList(Block() for _ in range(2))

    model = Twins()
    assert _same(find_layers(model), model.first)


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# ---- Hugging Face models (tiny random configs, no downloads) -------------------------

_COMMON = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=1,
)


def _hf(name: str) -> tuple[nn.Module, nn.Module]:
    """A tiny model and the ModuleList that holds its decoder layers."""
    t = transformers
    if name == "llama":
        model = t.LlamaForCausalLM(t.LlamaConfig(**_COMMON))
    elif name == "mistral":
        model = t.MistralForCausalLM(t.MistralConfig(**_COMMON))
    elif name == "qwen2":
        model = t.Qwen2ForCausalLM(t.Qwen2Config(**_COMMON))
    elif name == "qwen2_moe":
        cfg = t.Qwen2MoeConfig(
            **_COMMON,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
        )
        model = t.Qwen2MoeForCausalLM(cfg)
    elif name == "mixtral":
        cfg = t.MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2)
        model = t.MixtralForCausalLM(cfg)
    elif name == "gpt2":
        cfg = t.GPT2Config(
            vocab_size=64,
            n_embd=16,
            n_layer=3,
            n_head=2,
            n_positions=32,
            bos_token_id=0,
            eos_token_id=0,
        )
        model = t.GPT2LMHeadModel(cfg)
        return model, model.transformer.h
    else:  # pragma: no cover
        raise AssertionError(name)
    return model, model.model.layers


@needs_transformers
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen2_moe", "mixtral", "gpt2"])
def test_hf_decoder_models(name: str) -> None:
    model, layers = _hf(name)
    found = offload.find_layers(model)
    assert _same(found, layers)
    assert len(found) == 3
    assert len({type(m) for m in found}) == 1
    path = "transformer.h" if name == "gpt2" else "model.layers"
    assert _same(offload.find_layers(model, attr=path), layers)


@needs_transformers
def test_hf_base_model_without_head() -> None:
    model, layers = _hf("llama")
    assert _same(find_layers(model.model), layers)


# ---- attr override -------------------------------------------------------------------


def test_attr_dotted_path() -> None:
    model = MoEModel(num_layers=3)
    assert _same(find_layers(model, attr="layers"), model.layers)
    # the override may name what the search would never pick
    assert _same(find_layers(model, attr="layers.1.experts"), model.layers[1].experts)


def test_attr_mixed_classes_allowed() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with pytest.raises(ValueError):
        find_layers(model)
    holder = nn.Module()
    holder.stack = model
    assert _same(find_layers(holder, attr="stack"), model)


def test_attr_plain_list_of_modules() -> None:
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(2))
            self.plain = [self.blocks[1], self.blocks[0]]  # not registered

    model = Holder()
    assert _same(find_layers(model, attr="plain"), model.plain)


def test_attr_returns_a_new_list() -> None:
    model = nn.Sequential(Block(), Block())
    found = find_layers(model)
    found.pop()
    assert len(model) == 2


@pytest.mark.parametrize(
    ("attr", "match"),
    [
        ("model.layer", r"attr='model.layer': model \(Inner\) has no attribute 'layer'"),
        ("nope", r"the model \(Outer\) has no attribute 'nope'; its children are \['model'\]"),
        ("model.layers.0", r"names a Block; it must name an nn.ModuleList"),
        ("model.empty", r"names an empty ModuleList"),
        ("model.bad", r"item 1 is a int, not an nn.Module"),
        ("", r"is not a dotted attribute path"),
        ("model..layers", r"is not a dotted attribute path"),
    ],
)
def test_attr_errors(attr: str, match: str) -> None:
    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(2))
            self.empty = nn.ModuleList()
            self.bad = [Block(), 3]

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Inner()

    with pytest.raises(ValueError, match=match):
        find_layers(Outer(), attr=attr)


# ---- errors --------------------------------------------------------------------------


@pytest.mark.parametrize("model", [None, [nn.Linear(2, 2)], "model.layers", torch.zeros(2)])
def test_model_must_be_a_module(model: object) -> None:
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module; got"):
        find_layers(model)  # type: ignore[arg-type]


@pytest.mark.parametrize("attr", [1, ["model", "layers"], b"layers"])
def test_attr_must_be_a_str(attr: object) -> None:
    with pytest.raises(TypeError, match=r"attr must be a str .* or None; got"):
        find_layers(nn.Sequential(Block(), Block()), attr=attr)  # type: ignore[arg-type]


def test_nothing_fits_lists_what_was_examined() -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
            self.one = nn.ModuleList([Block()])
            self.none = nn.ModuleList()
            self.wrap = nn.Sequential(nn.Linear(4, 4))

    with pytest.raises(ValueError) as info:
        find_layers(Odd())
    message = str(info.value)
    assert "find_layers found no repeated blocks in Odd" in message
    assert "examined 4 container(s)" in message
    assert "'head' (Sequential of 2: Linear x1, ReLU x1; mixed classes)" in message
    assert "'one' (ModuleList of 1: Block x1; a single block; not searched inside)" in message
    assert "'none' (ModuleList of 0: empty; empty)" in message
    assert "'wrap' (Sequential of 1: Linear x1; one module)" in message
    assert "attr=" in message


def test_nothing_fits_without_containers() -> None:
    with pytest.raises(ValueError, match=r"examined 3 module\(s\), none is an nn.ModuleList"):
        find_layers(Block())


def test_single_linear() -> None:
    with pytest.raises(ValueError, match="no repeated blocks in Linear"):
        find_layers(nn.Linear(2, 2))


def test_reexported() -> None:
    assert offload.find_layers is find_layers
    assert find_layers.__doc__ and "Raises:" in find_layers.__doc__


def test_result_feeds_the_offloader() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(32) for _ in range(3)))
    x = torch.randn(4, 32)
    ref = nn.Sequential(*(Block(32) for _ in range(3)))
    ref.load_state_dict(model.state_dict())
    ref(x).square().mean().backward()
    off = offload.ActivationOffloader(find_layers(model), min_tensor_bytes=0)
    with off:
        loss = model(x).square().mean()
    loss.backward()
    assert [la.bytes_offloaded > 0 for la in off.stats.layers] == [True, True, False]
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    off.close()
