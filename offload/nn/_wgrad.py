"""Weight-gradient plumbing shared by ``offload.nn.Linear`` and ``offload.nn.GroupedLinear``.

This module answers one question for the fused layers: *where does dW go, and with which
GEMM?* (docs/design.md 4.9).

Where dW goes, decided in backward for each weight:

1. Under FSDP2, once ``offload.integrations.fsdp.use_fused_wgrad(model)`` has run, the layer
   carries the weight's ``FSDPParam``; dW goes into that FSDPParam's
   ``unsharded_accumulated_grad`` (see ``offload/integrations/fsdp.py`` for why not
   ``.grad``): beta = 0 into a freshly allocated buffer when there is none (FSDP frees it
   after its reduce-scatter), beta = 1 into the existing one while gradient sync is off.
2. Otherwise into ``weight.main_grad``: beta = 1 (``main_grad += dW``), or beta = 0
   (``main_grad = dW``) when the weight has ``overwrite_main_grad=True``.

Which GEMM writes it (``gemm_wgrad_into``):

- same dtype for the operands and the buffer (fp32 weights, fp32 ``main_grad``):
  ``buffer.addmm_(dY^T, X, beta=beta)``, fused on every device;
- bf16/fp16 operands into an fp32 buffer on CUDA: ``torch.addmm(buffer, dY^T, X,
  torch.float32, beta=beta, out=buffer)`` (the ``addmm.dtype_out`` overload, one cuBLAS
  GEMM with fp32 output and beta; checked on torch 2.11 + H200, where it is what runs).
  The overload is documented as CUDA-only, and some torch versions' kernel required
  ``self`` in the operands' dtype, so it is probed once per device and dtype (see
  ``_fp32_out_gemm_mode``); if it is refused, ``torch.baddbmm(..., out_dtype)`` on
  unsqueezed views does the same job; only if both are refused is the fallback used.
- fallback (CPU, where the ``out_dtype`` overloads have no kernel, and any device that
  refuses both): dW is computed in the operands' dtype (exactly what ``nn.Linear``'s
  ``.grad`` would be) and added into / copied to the buffer. This materialises one
  full-size dW at a time; the result equals "reference ``.grad`` then ``main_grad +=
  grad.float()``" up to the GEMM's own rounding.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

__all__ = [
    "check_weight_version",
    "deref_weight",
    "finish_weight_grad",
    "gemm_wgrad_into",
    "require_main_grad",
    "wgrad_mode",
    "write_weight_grad",
]

# (device type, device index, operand dtype, buffer dtype) -> "addmm" | "baddbmm" | "fallback"
_MODE_CACHE: dict[tuple[str, int | None, torch.dtype, torch.dtype], str] = {}
_MODE_LOCK = threading.Lock()


def _probe_addmm(device: torch.device, op_dtype: torch.dtype, buf_dtype: torch.dtype) -> bool:
    a = torch.ones(2, 3, device=device, dtype=op_dtype)
    b = torch.ones(3, 4, device=device, dtype=op_dtype)
    c = torch.full((2, 4), 0.5, device=device, dtype=buf_dtype)
    ptr = c.data_ptr()
    torch.addmm(c, a, b, buf_dtype, beta=1, out=c)
    return c.data_ptr() == ptr and bool((c == 3.5).all())


def _probe_baddbmm(device: torch.device, op_dtype: torch.dtype, buf_dtype: torch.dtype) -> bool:
    a = torch.ones(2, 3, device=device, dtype=op_dtype)
    b = torch.ones(3, 4, device=device, dtype=op_dtype)
    c = torch.full((2, 4), 0.5, device=device, dtype=buf_dtype)
    ptr = c.data_ptr()
    c3 = c.unsqueeze(0)
    torch.baddbmm(c3, a.unsqueeze(0), b.unsqueeze(0), buf_dtype, beta=1, out=c3)
    return c.data_ptr() == ptr and bool((c == 3.5).all())


def _fp32_out_gemm_mode(device: torch.device, op_dtype: torch.dtype, buf_dtype: torch.dtype) -> str:
    """How a GEMM with ``op_dtype`` operands accumulates into a ``buf_dtype`` buffer here.

    Probed once per (device, dtypes) with a 2x3x4 product (the answer is cached; the probe
    synchronises the host with the device once, the first time a fused backward runs).
    """
    key = (device.type, device.index, op_dtype, buf_dtype)
    mode = _MODE_CACHE.get(key)
    if mode is not None:
        return mode
    with _MODE_LOCK:
        mode = _MODE_CACHE.get(key)
        if mode is not None:
            return mode
        mode = "fallback"
        if (
            device.type == "cuda"
            and buf_dtype == torch.float32
            and op_dtype in (torch.bfloat16, torch.float16)
        ):
            for name, probe in (("addmm", _probe_addmm), ("baddbmm", _probe_baddbmm)):
                try:
                    if probe(device, op_dtype, buf_dtype):
                        mode = name
                        break
                except (RuntimeError, TypeError, NotImplementedError):
                    continue
        _MODE_CACHE[key] = mode
        return mode


def wgrad_mode(device: torch.device | str, op_dtype: torch.dtype, buf_dtype: torch.dtype) -> str:
    """Which kernel writes ``buffer (buf_dtype) [+]= dY^T @ X (op_dtype)`` on ``device``.

    Args:
        device: the device of the operands and the buffer.
        op_dtype: dtype of dY and X (the layer's compute dtype).
        buf_dtype: dtype of the buffer (``main_grad``, or FSDP's reduce dtype).

    Returns:
        ``"same-dtype"`` (``addmm_`` into the buffer), ``"addmm"`` or ``"baddbmm"``
        (the ``out_dtype`` overloads: one GEMM, fp32 output, beta; nothing full-size in
        ``op_dtype``), or ``"fallback"`` (dW materialised in ``op_dtype``, then added).

    Example:
        >>> wgrad_mode("cpu", torch.bfloat16, torch.float32)
        'fallback'
    """
    device = torch.device(device)
    if op_dtype == buf_dtype:
        return "same-dtype"
    return _fp32_out_gemm_mode(device, op_dtype, buf_dtype)


def gemm_wgrad_into(
    buffer: torch.Tensor, grad_out: torch.Tensor, inp: torch.Tensor, *, accumulate: bool
) -> None:
    """``buffer = (buffer if accumulate else 0) + grad_out^T @ inp`` with the best GEMM here.

    Args:
        buffer: [out, in] destination, written in place (``main_grad`` or FSDP's buffer).
        grad_out: [M, out] gradient of the layer output (2-D).
        inp: [M, in] layer input (2-D), same dtype as ``grad_out``.
        accumulate: beta = 1 when True, beta = 0 (the old contents are ignored, NaN/Inf
            included) when False.

    With M = 0 (an expert that got no tokens) nothing is computed: the buffer is zeroed
    when ``accumulate`` is False and left untouched otherwise.
    """
    if grad_out.shape[0] == 0:
        if not accumulate:
            buffer.zero_()
        return
    beta = 1 if accumulate else 0
    mode = wgrad_mode(buffer.device, grad_out.dtype, buffer.dtype)
    if mode == "same-dtype":
        buffer.addmm_(grad_out.t(), inp, beta=beta)
    elif mode == "addmm":
        torch.addmm(buffer, grad_out.t(), inp, buffer.dtype, beta=beta, out=buffer)
    elif mode == "baddbmm":
        out3 = buffer.unsqueeze(0)
        torch.baddbmm(
            out3, grad_out.t().unsqueeze(0), inp.unsqueeze(0), buffer.dtype, beta=beta, out=out3
        )
    else:
        dw = torch.mm(grad_out.t(), inp)
        if accumulate:
            buffer.add_(dw)
        else:
            buffer.copy_(dw)


def deref_weight(ref: weakref.ReferenceType, layer: str, name: str) -> torch.nn.Parameter:
    """The weight Parameter behind ``ref``; RuntimeError if it was freed before backward."""
    weight = ref()
    if weight is None:
        raise RuntimeError(
            f"{layer}: the parameter {name!r} used in the forward was freed before the "
            "backward; keep the module (and its parameters) alive until backward has run"
        )
    return weight


def check_weight_version(weight: torch.Tensor, version: int, layer: str, name: str) -> None:
    """Autograd's in-place check for a weight that was not saved with save_for_backward."""
    if weight._version != version:
        raise RuntimeError(
            f"{layer}: one of the variables needed for gradient computation has been "
            f"modified by an inplace operation: the parameter {name!r} "
            f"[{', '.join(map(str, weight.shape))}] ({weight.dtype}) is at version "
            f"{weight._version}; expected version {version} instead. Do not update the "
            "weights (optimizer.step(), in-place edits) between a forward and its backward."
        )


def require_main_grad(weight: torch.Tensor, layer: str, name: str) -> torch.Tensor:
    """``weight.main_grad``, validated; RuntimeError naming ``offload.main_grad.attach``."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        raise RuntimeError(
            f"{layer} was built with fuse_wgrad_accumulation=True, but its parameter "
            f"{name!r} has no main_grad buffer to accumulate into. Call "
            "offload.main_grad.attach(model) before the first backward (under FSDP2 call "
            "offload.integrations.fsdp.use_fused_wgrad(model) after fully_shard instead), "
            "or build the layer with fuse_wgrad_accumulation=False."
        )
    if not isinstance(main_grad, torch.Tensor):
        raise TypeError(
            f"{layer}: {name}.main_grad must be a torch.Tensor, got "
            f"{type(main_grad).__name__}; use offload.main_grad.attach(model) to create it"
        )
    if main_grad.shape != weight.shape or main_grad.device != weight.device:
        raise RuntimeError(
            f"{layer}: {name}.main_grad has shape {tuple(main_grad.shape)} on "
            f"{main_grad.device}, but the parameter has shape {tuple(weight.shape)} on "
            f"{weight.device}; re-create it with offload.main_grad.attach(model) after "
            "moving the model"
        )
    return main_grad


def finish_weight_grad(weight: torch.nn.Parameter) -> torch.Tensor | None:
    """What the autograd Function returns for a weight whose dW went into main_grad.

    ``None`` (no ``.grad``), unless the weight has the attribute
    ``grad_added_to_main_grad``: then it is set to True and a zero gradient is returned
    that allocates nothing full-size (a 0-d zero expanded to the weight's shape, stride
    0), so that DDP-style hooks on the parameter's gradient accumulator fire. Note that
    autograd's ``AccumulateGrad`` stores a stride-0 gradient into an empty ``.grad`` by
    cloning it (a full-size zero tensor), so such hooks are expected to set ``.grad`` to
    None, as Megatron-LM's do.
    """
    if hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
        return torch.zeros((), dtype=weight.dtype, device=weight.device).expand_as(weight)
    return None


def write_weight_grad(
    weight: torch.nn.Parameter,
    fsdp_param: Any | None,
    grad_out: torch.Tensor,
    inp: torch.Tensor,
    layer: str,
    name: str,
) -> torch.Tensor | None:
    """Write dW = grad_out^T @ inp where it belongs; return what autograd gets for the weight.

    Args:
        weight: the Parameter (the unsharded one under FSDP2).
        fsdp_param: the weight's ``FSDPParam`` when ``use_fused_wgrad`` was applied, else
            None.
        grad_out: [M, out] output gradient in the compute dtype.
        inp: [M, in] input in the compute dtype.
        layer: the layer's description, for error messages.
        name: the parameter's name inside the layer, for error messages.

    Returns:
        The tensor the autograd Function returns for the weight: None, or the dummy of
        ``finish_weight_grad``.

    Raises:
        RuntimeError: no ``main_grad`` on the weight (outside FSDP2), or a mismatched one.
    """
    if fsdp_param is not None:
        buffer = fsdp_param.unsharded_accumulated_grad
        if buffer is None:
            dtype = fsdp_param.reduce_dtype or weight.dtype
            buffer = torch.empty(weight.shape, dtype=dtype, device=weight.device)
            gemm_wgrad_into(buffer, grad_out, inp, accumulate=False)
            fsdp_param.unsharded_accumulated_grad = buffer
        else:
            gemm_wgrad_into(buffer, grad_out, inp, accumulate=True)
        return None
    main_grad = require_main_grad(weight, layer, name)
    overwrite = bool(getattr(weight, "overwrite_main_grad", False))
    gemm_wgrad_into(main_grad, grad_out, inp, accumulate=not overwrite)
    return finish_weight_grad(weight)
