"""Helpers for ``main_grad`` buffers (docs/design.md 4.9).

A ``main_grad`` is a buffer beside a parameter (usually fp32, same shape) into which the
fused layers of ``offload.nn`` write their weight gradients (``main_grad += dW``, or
``main_grad = dW`` when the parameter has ``overwrite_main_grad=True``). The usual loop::

    offload.main_grad.attach(model)              # once
    for step in ...:
        for micro_batch in ...:
            loss_fn(model(micro_batch)).backward()   # fused layers: main_grad += dW
        offload.main_grad.to_grads(model)        # main_grad (+ autograd's .grad) -> .grad
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        offload.main_grad.zero_(model)

Parameters that are not weights of fused layers (biases, norms, routers) still get their
gradients in ``.grad`` from autograd; ``to_grads`` adds the two, so the optimizer sees the
full gradient of every parameter.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["attach", "zero_", "to_grads"]


def _check_module(fn: str, module: object) -> nn.Module:
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"offload.main_grad.{fn}(module=...) must be a torch.nn.Module, got "
            f"{type(module).__name__}"
        )
    return module


def _params_with_main_grad(fn: str, module: object) -> list[nn.Parameter]:
    """The parameters of ``module`` that have a ``main_grad``; at least one, else raise."""
    params = [
        p
        for p in _check_module(fn, module).parameters()
        if getattr(p, "main_grad", None) is not None
    ]
    if not params:
        raise ValueError(
            f"offload.main_grad.{fn}: no parameter of {type(module).__name__} has a "
            "main_grad; call offload.main_grad.attach(module) first"
        )
    return params


def attach(
    module: nn.Module, dtype: torch.dtype = torch.float32, contiguous: bool = False
) -> list[nn.Parameter]:
    """Give every parameter of ``module`` that requires grad a zeroed ``main_grad`` buffer.

    Each buffer has the parameter's shape and device and the given ``dtype``. With
    ``contiguous=True`` all buffers are views into one flat tensor (reachable as
    ``p.main_grad._base``), in ``module.parameters()`` order, so that one collective or
    one ``zero_()`` covers them all. A parameter that already has a ``main_grad`` of the
    right shape, device and dtype keeps it (and its contents) when ``contiguous`` is
    False; with ``contiguous=True`` every buffer is replaced. Shared (tied) parameters
    get one buffer. Parameters with ``requires_grad=False`` get none.

    Args:
        module: the model (or any submodule).
        dtype: floating dtype of the buffers. Default: ``torch.float32``.
        contiguous: allocate one flat buffer and give each parameter a view of it.
            Default: False (one allocation per parameter).

    Returns:
        The parameters that now carry a ``main_grad``, in ``module.parameters()`` order.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, ``dtype`` not a floating
            ``torch.dtype``, or ``contiguous`` not a bool.
        ValueError: with ``contiguous=True`` the parameters live on several devices; a
            parameter is a DTensor (FSDP2 / tensor parallel: under FSDP2 call
            ``offload.integrations.fsdp.use_fused_wgrad(model)`` instead) or on the meta
            device (materialise the model first).

    Example:
        >>> import torch, offload
        >>> model = torch.nn.Sequential(offload.nn.Linear(8, 8, fuse_wgrad_accumulation=True))
        >>> params = offload.main_grad.attach(model)
        >>> [tuple(p.main_grad.shape) for p in params], params[0].main_grad.dtype
        ([(8, 8), (8,)], torch.float32)
    """
    _check_module("attach", module)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(
            f"offload.main_grad.attach(dtype=...) must be a floating torch.dtype, got {dtype!r}"
        )
    if not isinstance(contiguous, bool):
        raise TypeError(
            f"offload.main_grad.attach(contiguous=...) must be a bool, got {contiguous!r}"
        )
    names = {id(p): n for n, p in module.named_parameters()}
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        if type(p).__name__ == "DTensor" or type(p.data).__name__ == "DTensor":
            raise ValueError(
                f"offload.main_grad.attach: parameter {names[id(p)]!r} is a DTensor; a "
                "main_grad beside a sharded parameter would not see the unsharded weight "
                "gradient. Under FSDP2 call offload.integrations.fsdp.use_fused_wgrad(model) "
                "after fully_shard instead of attach."
            )
        if p.device.type == "meta":
            raise ValueError(
                f"offload.main_grad.attach: parameter {names[id(p)]!r} is on the meta "
                "device; materialise the model (to_empty + init) before attaching buffers"
            )
    if contiguous and params:
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(
                "offload.main_grad.attach(contiguous=True): the parameters live on "
                f"{sorted(map(str, devices))}; one flat buffer cannot span devices. Attach "
                "per device submodule, or pass contiguous=False."
            )
        total = sum(p.numel() for p in params)
        flat = torch.zeros(total, dtype=dtype, device=params[0].device)
        offset = 0
        for p in params:
            p.main_grad = flat[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
        return params
    for p in params:
        mg = getattr(p, "main_grad", None)
        if (
            isinstance(mg, torch.Tensor)
            and mg.shape == p.shape
            and mg.dtype == dtype
            and mg.device == p.device
        ):
            continue
        p.main_grad = torch.zeros(p.shape, dtype=dtype, device=p.device)
    return params


def zero_(module: nn.Module) -> None:
    """Zero every ``main_grad`` under ``module`` and reset ``grad_added_to_main_grad``.

    Buffers that are views of one flat tensor (``attach(..., contiguous=True)``) are
    zeroed with one ``zero_()`` of that tensor. Parameters that have the attribute
    ``grad_added_to_main_grad`` get it set back to False.

    Args:
        module: the model (or any submodule) whose buffers to zero.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        ValueError: no parameter of ``module`` has a ``main_grad`` (call
            ``offload.main_grad.attach(module)`` first).

    Example:
        >>> import torch, offload
        >>> layer = offload.nn.Linear(4, 4, fuse_wgrad_accumulation=True)
        >>> _ = offload.main_grad.attach(layer)
        >>> layer(torch.randn(2, 4)).sum().backward()
        >>> offload.main_grad.zero_(layer)
        >>> bool(layer.weight.main_grad.eq(0).all())
        True
    """
    params = _params_with_main_grad("zero_", module)
    zeroed: set[int] = set()
    for p in params:
        mg = p.main_grad
        base = mg._base if mg._base is not None else mg
        if id(base) not in zeroed:
            base.zero_()
            zeroed.add(id(base))
        if hasattr(p, "grad_added_to_main_grad"):
            p.grad_added_to_main_grad = False


def to_grads(module: nn.Module) -> None:
    """Put the gradient of every parameter that has a ``main_grad`` into ``.grad``.

    For each such parameter: ``.grad = (main_grad + .grad).to(param.dtype)`` when autograd
    also left a ``.grad`` (a parameter that is not the weight of a fused layer, such as a
    bias, or the zero dummy of ``grad_added_to_main_grad``), else
    ``.grad = main_grad.to(param.dtype)``, always a new tensor (a copy even when the
    dtypes match), so the optimizer never aliases the buffer. The sum is formed in the
    ``main_grad`` dtype. Call it once per optimizer step, after the last backward and
    before ``optimizer.step()``; then ``optimizer.zero_grad()`` and ``zero_(module)``
    start the next accumulation (calling it twice without zeroing would count
    ``.grad`` twice).

    Args:
        module: the model (or any submodule).

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        ValueError: no parameter of ``module`` has a ``main_grad`` (call
            ``offload.main_grad.attach(module)`` first).

    Example:
        >>> import torch, offload
        >>> layer = offload.nn.Linear(4, 4, fuse_wgrad_accumulation=True)
        >>> _ = offload.main_grad.attach(layer)
        >>> opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        >>> layer(torch.randn(2, 4)).sum().backward()
        >>> offload.main_grad.to_grads(layer)
        >>> torch.equal(layer.weight.grad, layer.weight.main_grad)
        True
        >>> opt.step(); opt.zero_grad(); offload.main_grad.zero_(layer)
    """
    params = _params_with_main_grad("to_grads", module)
    with torch.no_grad():
        for p in params:
            mg = p.main_grad
            if p.grad is not None:
                total = mg + p.grad.to(mg.dtype)
                p.grad = total.to(p.dtype)
            else:
                p.grad = mg.to(dtype=p.dtype, copy=True)
