"""``offload.nn.Linear``: ``nn.Linear`` whose weight gradient goes straight into ``main_grad``."""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from offload.nn._wgrad import (
    check_weight_version,
    deref_weight,
    require_main_grad,
    write_weight_grad,
)

__all__ = ["Linear"]


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast compute dtype for ``device_type``, or None when autocast is off there."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


class _FusedLinearFunction(torch.autograd.Function):
    """y = x W^T + b; backward writes dW into main_grad (or FSDP's buffer), not into .grad.

    Saved for backward: the input only (an activation, offloadable). The weight is reached
    through a weak reference to the Parameter, so its attributes (``main_grad``,
    ``overwrite_main_grad``, ``grad_added_to_main_grad``) are those of the Parameter
    itself, whatever saved-tensor hooks do; its version is recorded here and checked in
    backward, as autograd would for a saved tensor.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: nn.Parameter,
        bias: torch.Tensor | None,
        fsdp_param: Any | None,
        layer: str,
    ) -> torch.Tensor:
        compute_dtype = autocast_dtype(x.device.type)
        if compute_dtype is not None:
            x = x.to(compute_dtype)
            w = weight.to(compute_dtype)
            b = bias.to(compute_dtype) if bias is not None else None
            with torch.autocast(x.device.type, enabled=False):
                out = F.linear(x, w, b)
        else:
            out = F.linear(x, weight, bias)
        if ctx.needs_input_grad[1]:
            ctx.save_for_backward(x)
        ctx.weight_ref = weakref.ref(weight)
        ctx.weight_version = weight._version
        ctx.fsdp_param = fsdp_param
        ctx.compute_dtype = compute_dtype
        ctx.layer = layer
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        weight = deref_weight(ctx.weight_ref, ctx.layer, "weight")
        check_weight_version(weight, ctx.weight_version, ctx.layer, "weight")
        out_features, in_features = weight.shape
        if ctx.compute_dtype is not None:
            grad_out = grad_out.to(ctx.compute_dtype)
        g2 = grad_out.reshape(-1, out_features)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            w = weight if ctx.compute_dtype is None else weight.to(ctx.compute_dtype)
            grad_x = torch.mm(g2, w).view(*grad_out.shape[:-1], in_features)
        if ctx.needs_input_grad[1]:
            (x,) = ctx.saved_tensors
            x2 = x.reshape(-1, in_features)
            grad_w = write_weight_grad(weight, ctx.fsdp_param, g2, x2, ctx.layer, "weight")
        if ctx.needs_input_grad[2]:
            grad_b = g2.sum(0)
        return grad_x, grad_w, grad_b, None, None


class Linear(nn.Linear):
    """``torch.nn.Linear`` with optional fused weight-gradient accumulation (docs/design.md 4.9).

    Same constructor, initialisation, parameters (``weight`` [out, in], ``bias`` [out]) and
    state dict as ``torch.nn.Linear``. With ``fuse_wgrad_accumulation=False`` it *is*
    ``nn.Linear`` (the forward is ``F.linear``).

    With ``fuse_wgrad_accumulation=True`` the backward writes dW = dY^T X straight into
    ``weight.main_grad`` (create it with ``offload.main_grad.attach``):

    - ``main_grad += dW`` (GEMM beta = 1), or ``main_grad = dW`` (beta = 0) when the weight
      has ``overwrite_main_grad=True`` (the buffer is reused each micro-batch, no zeroing;
      this assumes the weight is used once per backward, as in TransformerEngine);
    - the weight then gets no ``.grad``, unless it has the attribute
      ``grad_added_to_main_grad``: that is set to True and a zero gradient that allocates
      nothing full-size (an expanded 0-d tensor) is returned, so DDP-style hooks fire;
    - on CUDA, bf16/fp16 weights with an fp32 ``main_grad`` use one GEMM with an fp32
      output and beta (``torch.addmm(..., out_dtype=torch.float32, out=main_grad)``): no
      full-size dW in the parameter dtype exists. Elsewhere (CPU) dW is computed in the
      parameter dtype and added (``offload.nn._wgrad`` has the details and tolerances);
      fp32 weights with an fp32 ``main_grad`` use ``main_grad.addmm_`` on every device;
    - the bias gradient goes to ``bias.grad`` as usual (as in TransformerEngine, only the
      weight is fused);
    - under FSDP2, after ``offload.integrations.fsdp.use_fused_wgrad(model)``, dW goes into
      FSDP's unsharded gradient instead, and no ``main_grad`` is needed.

    Under ``torch.autocast`` the input, weight and bias are cast to the autocast dtype as
    ``nn.Linear`` would be; dW is computed from the cast operands.

    Args:
        in_features: size of each input sample.
        out_features: size of each output sample.
        bias: learn an additive bias. Default: True.
        device: device of the parameters. Default: None (the current default device).
        dtype: dtype of the parameters. Default: None (the default dtype).
        fuse_wgrad_accumulation: write the weight gradient into ``weight.main_grad``
            instead of ``weight.grad``. Keyword-only. Default: False.

    Raises:
        TypeError: ``fuse_wgrad_accumulation`` is not a bool.
        RuntimeError: (forward with gradients enabled, or backward) fusion is on and the
            weight has no ``main_grad`` and the layer is not under ``use_fused_wgrad``;
            the message names ``offload.main_grad.attach``.

    Example:
        >>> import torch, offload
        >>> layer = offload.nn.Linear(16, 8, fuse_wgrad_accumulation=True)
        >>> _ = offload.main_grad.attach(layer)
        >>> layer(torch.randn(4, 16)).sum().backward()
        >>> layer.weight.grad is None, layer.weight.main_grad.abs().sum() > 0
        (True, tensor(True))
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        fuse_wgrad_accumulation: bool = False,
    ) -> None:
        if not isinstance(fuse_wgrad_accumulation, bool):
            raise TypeError(
                "Linear(fuse_wgrad_accumulation=...) must be a bool, got "
                f"{fuse_wgrad_accumulation!r} ({type(fuse_wgrad_accumulation).__name__})"
            )
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        # Filled by offload.integrations.fsdp.use_fused_wgrad: {"weight": FSDPParam}.
        self._fsdp_wgrad: dict[str, Any] = {}

    def _describe(self) -> str:
        return (
            f"offload.nn.Linear(in_features={self.in_features}, out_features={self.out_features})"
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if not (self.fuse_wgrad_accumulation and torch.is_grad_enabled() and weight.requires_grad):
            return F.linear(input, weight, self.bias)
        fsdp_param = self._fsdp_wgrad.get("weight")
        if fsdp_param is None:
            require_main_grad(weight, self._describe(), "weight")
        return _FusedLinearFunction.apply(input, weight, self.bias, fsdp_param, self._describe())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fuse_wgrad_accumulation={self.fuse_wgrad_accumulation}"
