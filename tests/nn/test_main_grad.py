"""offload.main_grad: attach, zero_, to_grads."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import offload
from offload.nn import GroupedLinear, Linear


def _model(dtype: torch.dtype = torch.float32, fuse: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        Linear(8, 6, dtype=dtype, fuse_wgrad_accumulation=fuse),
        nn.LayerNorm(6, dtype=dtype),
        Linear(6, 4, bias=False, dtype=dtype),
    )
    model[1].weight.requires_grad_(False)  # frozen: gets no buffer
    return model


def test_attach_per_parameter():
    model = _model()
    params = offload.main_grad.attach(model)
    expected = [model[0].weight, model[0].bias, model[1].bias, model[2].weight]
    assert [id(p) for p in params] == [id(p) for p in expected]
    for p in params:
        assert p.main_grad.shape == p.shape and p.main_grad.dtype == torch.float32
        assert p.main_grad.device == p.device and not p.main_grad.any()
    assert not hasattr(model[1].weight, "main_grad")
    # distinct allocations
    assert len({p.main_grad.data_ptr() for p in params}) == len(params)
    # attaching again keeps matching buffers (and what they hold)
    model[0].weight.main_grad.fill_(2.0)
    offload.main_grad.attach(model)
    assert model[0].weight.main_grad.eq(2.0).all()
    # another dtype replaces them
    offload.main_grad.attach(model, dtype=torch.float64)
    assert model[0].weight.main_grad.dtype == torch.float64 and not model[0].weight.main_grad.any()


def test_attach_contiguous_views_of_one_buffer():
    model = _model()
    params = offload.main_grad.attach(model, contiguous=True)
    base = params[0].main_grad._base
    assert base is not None and base.dim() == 1
    assert base.numel() == sum(p.numel() for p in params)
    offset = 0
    for p in params:
        assert p.main_grad._base is base and p.main_grad.is_contiguous()
        assert p.main_grad.data_ptr() == base.data_ptr() + offset * base.element_size()
        offset += p.numel()
    base.fill_(1.0)
    offload.main_grad.zero_(model)
    assert not base.any()


def test_shared_parameter_gets_one_buffer():
    lin = Linear(4, 4, fuse_wgrad_accumulation=True)
    model = nn.Sequential(lin, nn.Tanh(), lin)
    params = offload.main_grad.attach(model)
    assert len(params) == 2
    model(torch.randn(3, 4)).sum().backward()
    assert lin.weight.main_grad.any() and lin.weight.grad is None


def test_attach_errors():
    with pytest.raises(TypeError, match=r"attach\(module=\.\.\.\).*got Tensor"):
        offload.main_grad.attach(torch.zeros(2))
    with pytest.raises(TypeError, match=r"attach\(dtype=\.\.\.\).*torch\.int32"):
        offload.main_grad.attach(_model(), dtype=torch.int32)
    with pytest.raises(TypeError, match=r"attach\(contiguous=\.\.\.\)"):
        offload.main_grad.attach(_model(), contiguous="yes")
    meta = nn.Linear(4, 4, device="meta")
    with pytest.raises(ValueError, match="meta device"):
        offload.main_grad.attach(meta)


def test_zero_resets_buffers_and_flag():
    model = _model()
    offload.main_grad.attach(model)
    model[0].weight.grad_added_to_main_grad = False
    model(torch.randn(5, 8)).sum().backward()
    assert model[0].weight.main_grad.any() and model[0].weight.grad_added_to_main_grad
    offload.main_grad.zero_(model)
    assert all(not p.main_grad.any() for p in model.parameters() if hasattr(p, "main_grad"))
    assert model[0].weight.grad_added_to_main_grad is False
    with pytest.raises(ValueError, match=r"no parameter of Linear has a main_grad.*attach"):
        offload.main_grad.zero_(nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"zero_\(module=\.\.\.\)"):
        offload.main_grad.zero_(None)


def test_to_grads_gives_the_optimizer_the_full_gradient():
    """main_grad for fused weights, autograd's .grad for the rest; same as a plain model."""
    model = _model()
    ref = _model(fuse=False)
    offload.main_grad.attach(model)
    xs = [torch.randn(5, 8) for _ in range(2)]
    for x in xs:
        model(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
    offload.main_grad.to_grads(model)
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        if not p.requires_grad:
            continue
        # fp32 rounding of the fused accumulation (see test_nn_linear.py)
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6, msg=name)
        assert p.grad.data_ptr() != p.main_grad.data_ptr()  # a copy, never an alias
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.step()


def test_to_grads_casts_to_parameter_dtype():
    layer = Linear(8, 4, dtype=torch.bfloat16, fuse_wgrad_accumulation=True)
    offload.main_grad.attach(layer, dtype=torch.float32)
    layer(torch.randn(3, 8, dtype=torch.bfloat16)).float().sum().backward()
    assert layer.weight.grad is None
    offload.main_grad.to_grads(layer)
    assert layer.weight.grad.dtype == torch.bfloat16
    assert torch.equal(layer.weight.grad, layer.weight.main_grad.to(torch.bfloat16))
    with pytest.raises(ValueError, match="attach"):
        offload.main_grad.to_grads(nn.Linear(2, 2))


def test_grouped_linear_attach_covers_every_expert():
    experts = GroupedLinear(3, 4, 5, fuse_wgrad_accumulation=True)
    params = offload.main_grad.attach(experts, contiguous=True)
    assert len(params) == 6
    experts(torch.randn(4, 4), [1, 0, 3]).sum().backward()
    assert experts.weight0.main_grad.any() and not experts.weight1.main_grad.any()
