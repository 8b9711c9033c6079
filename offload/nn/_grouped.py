"""``offload.nn.GroupedLinear``: the experts of an MoE layer, one GEMM per expert.

Layout (TransformerEngine's): parameters ``weight0..weight{E-1}`` [out, in] and
``bias0..bias{E-1}`` [out]; ``forward(x, m_splits)`` with x [sum(m_splits), in], rows
grouped by expert in order.

One GEMM per expert for the forward, the dgrad and the wgrad. torch offers a grouped GEMM
(``torch.nn.functional.grouped_mm``, bf16 on sm80+), but it wants the weights as one
[E, out, in] tensor: with one Parameter per expert (needed for per-expert ``main_grad``
and for FSDP2, which shards each Parameter separately) that is a copy of all expert
weights every forward and every backward, and its offsets must be a device tensor built
from ``m_splits``. It also has no beta, so it cannot accumulate into ``main_grad``. The
loop is kept; each expert's output and input gradient are written into slices of one
preallocated tensor (no ``torch.cat``).
"""

from __future__ import annotations

import math
import operator
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from offload.nn._linear import autocast_dtype
from offload.nn._wgrad import (
    check_weight_version,
    deref_weight,
    require_main_grad,
    write_weight_grad,
)

__all__ = ["GroupedLinear"]

# Arguments of _GroupedLinearFunction.forward before the parameters.
_N_META = 6


class _GroupedLinearFunction(torch.autograd.Function):
    """Per-expert y_i = x_i W_i^T + b_i over row groups of x.

    Saved for backward: the input only. Weights are reached through weak references to the
    Parameters (see ``_FusedLinearFunction``). With ``fuse`` False the weight gradients
    are returned normally (one [out, in] tensor per expert, zeros for an expert without
    tokens, as a per-expert ``nn.Linear`` would give); with ``fuse`` True each goes into
    its own ``main_grad`` (or FSDP buffer).
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        splits: tuple[int, ...],
        fuse: bool,
        fsdp_params: tuple[Any, ...] | None,
        layer: str,
        has_bias: bool,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        n = len(splits)
        weights = params[:n]
        biases = params[n:] if has_bias else (None,) * n
        compute_dtype = autocast_dtype(x.device.type)
        if compute_dtype is not None:
            x = x.to(compute_dtype)
        out_features = weights[0].shape[0]
        out = torch.empty((x.shape[0], out_features), dtype=x.dtype, device=x.device)
        start = 0
        with torch.autocast(x.device.type, enabled=False):
            for w, b, m in zip(weights, biases, splits, strict=True):
                if m == 0:
                    continue
                end = start + m
                if compute_dtype is not None:
                    w = w.to(compute_dtype)
                    b = b.to(compute_dtype) if b is not None else None
                if b is not None:
                    torch.addmm(b, x[start:end], w.t(), out=out[start:end])
                else:
                    torch.mm(x[start:end], w.t(), out=out[start:end])
                start = end
        if any(ctx.needs_input_grad[_N_META : _N_META + n]):
            ctx.save_for_backward(x)
        ctx.splits = splits
        ctx.fuse = fuse
        ctx.fsdp_params = fsdp_params
        ctx.layer = layer
        ctx.has_bias = has_bias
        ctx.compute_dtype = compute_dtype
        ctx.weight_refs = tuple(weakref.ref(w) for w in weights)
        ctx.weight_versions = tuple(w._version for w in weights)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        splits = ctx.splits
        n = len(splits)
        needs = ctx.needs_input_grad
        need_x = needs[0]
        need_w = needs[_N_META : _N_META + n]
        need_b = needs[_N_META + n :] if ctx.has_bias else ()
        if ctx.compute_dtype is not None:
            grad_out = grad_out.to(ctx.compute_dtype)
        x: Any = ctx.saved_tensors[0] if any(need_w) else None
        weights = []
        for i, (ref, version) in enumerate(zip(ctx.weight_refs, ctx.weight_versions, strict=True)):
            w = deref_weight(ref, ctx.layer, f"weight{i}")
            check_weight_version(w, version, ctx.layer, f"weight{i}")
            weights.append(w)
        in_features = weights[0].shape[1]
        grad_x: Any = None
        if need_x:
            grad_x = torch.empty(
                (grad_out.shape[0], in_features), dtype=grad_out.dtype, device=grad_out.device
            )
        grad_ws: list[torch.Tensor | None] = [None] * n
        grad_bs: list[torch.Tensor | None] = [None] * len(need_b)
        start = 0
        for i, m in enumerate(splits):
            end = start + m
            g = grad_out[start:end]
            w = weights[i]
            if need_x and m > 0:
                wc = w if ctx.compute_dtype is None else w.to(ctx.compute_dtype)
                torch.mm(g, wc, out=grad_x[start:end])
            if need_w[i]:
                xi = x[start:end]
                if ctx.fuse:
                    fsdp_param = ctx.fsdp_params[i] if ctx.fsdp_params is not None else None
                    grad_ws[i] = write_weight_grad(w, fsdp_param, g, xi, ctx.layer, f"weight{i}")
                else:
                    grad_ws[i] = torch.mm(g.t(), xi)
            if need_b and need_b[i]:
                grad_bs[i] = g.sum(0)
            start = end
        return (grad_x, None, None, None, None, None, *grad_ws, *grad_bs)


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"GroupedLinear({name}=...) must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"GroupedLinear({name}=...) must be >= 1, got {value}")
    return value


class GroupedLinear(nn.Module):
    """The experts of an MoE layer: ``num_experts`` linear maps applied to row groups.

    ``forward(x, m_splits)`` computes, for each expert i, ``x_i @ weight{i}.T + bias{i}``
    where ``x_i`` is the i-th group of ``m_splits[i]`` consecutive rows of ``x``, and
    returns the results concatenated in the same row order ([sum(m_splits), out]).

    Parameters (TransformerEngine's layout): ``weight0..weight{E-1}`` [out, in] and, with
    ``bias=True``, ``bias0..bias{E-1}`` [out], each initialised as ``nn.Linear`` would.
    With ``fuse_wgrad_accumulation=True`` each expert's weight gradient goes into its own
    ``main_grad`` with the rules of ``offload.nn.Linear`` (beta = 1, or beta = 0 with
    ``overwrite_main_grad``; dummy gradient with ``grad_added_to_main_grad``). An expert
    that got no tokens has zeros written in overwrite mode and is left untouched in
    accumulate mode. Bias gradients go to ``.grad``.

    Args:
        num_experts: number of experts E (>= 1).
        in_features: size of each input row (>= 1).
        out_features: size of each output row (>= 1).
        bias: learn a bias per expert. Default: True.
        device: device of the parameters. Default: None (the current default device).
        dtype: dtype of the parameters. Default: None (the default dtype).
        fuse_wgrad_accumulation: write weight gradients into ``weight{i}.main_grad``.
            Keyword-only. Default: False.

    Raises:
        TypeError: a size is not an int, or ``fuse_wgrad_accumulation`` not a bool.
        ValueError: a size is < 1.

    Example:
        >>> import torch, offload
        >>> experts = offload.nn.GroupedLinear(4, 16, 32)
        >>> x = torch.randn(10, 16)
        >>> experts(x, [3, 0, 5, 2]).shape
        torch.Size([10, 32])
    """

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        fuse_wgrad_accumulation: bool = False,
    ) -> None:
        super().__init__()
        self.num_experts = _check_positive_int("num_experts", num_experts)
        self.in_features = _check_positive_int("in_features", in_features)
        self.out_features = _check_positive_int("out_features", out_features)
        if not isinstance(bias, bool):
            raise TypeError(f"GroupedLinear(bias=...) must be a bool, got {bias!r}")
        if not isinstance(fuse_wgrad_accumulation, bool):
            raise TypeError(
                "GroupedLinear(fuse_wgrad_accumulation=...) must be a bool, got "
                f"{fuse_wgrad_accumulation!r} ({type(fuse_wgrad_accumulation).__name__})"
            )
        self.use_bias = bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        factory = {"device": device, "dtype": dtype}
        for i in range(num_experts):
            self.register_parameter(
                f"weight{i}", nn.Parameter(torch.empty(out_features, in_features, **factory))
            )
        for i in range(num_experts):
            self.register_parameter(
                f"bias{i}", nn.Parameter(torch.empty(out_features, **factory)) if bias else None
            )
        # Filled by offload.integrations.fsdp.use_fused_wgrad: {"weight3": FSDPParam, ...}.
        self._fsdp_wgrad: dict[str, Any] = {}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise every expert as ``nn.Linear.reset_parameters`` does."""
        for i in range(self.num_experts):
            w = getattr(self, f"weight{i}")
            nn.init.kaiming_uniform_(w, a=math.sqrt(5))
            b = getattr(self, f"bias{i}")
            if b is not None:
                bound = 1 / math.sqrt(self.in_features)
                nn.init.uniform_(b, -bound, bound)

    def _describe(self) -> str:
        return (
            f"offload.nn.GroupedLinear(num_experts={self.num_experts}, "
            f"in_features={self.in_features}, out_features={self.out_features})"
        )

    def _splits(self, m_splits: Any, rows: int) -> tuple[int, ...]:
        accepted = "a list or tuple of ints, or a 1-D integer tensor on the CPU"
        if isinstance(m_splits, torch.Tensor):
            if m_splits.device.type != "cpu":
                raise TypeError(
                    f"GroupedLinear.forward(m_splits=...) is a tensor on {m_splits.device}; "
                    "reading it would force a host sync. Pass "
                    f"{accepted} (call .tolist() once where a sync is acceptable)."
                )
            if (
                m_splits.dtype.is_floating_point
                or m_splits.dtype.is_complex
                or (m_splits.dtype == torch.bool)
            ):
                raise TypeError(
                    f"GroupedLinear.forward(m_splits=...) has dtype {m_splits.dtype}; "
                    f"expected {accepted}"
                )
            if m_splits.dim() != 1:
                raise ValueError(
                    "GroupedLinear.forward(m_splits=...) must be 1-D, got shape "
                    f"{tuple(m_splits.shape)}"
                )
            splits = tuple(int(v) for v in m_splits.tolist())
        elif isinstance(m_splits, Sequence) and not isinstance(m_splits, (str, bytes)):
            values = []
            for i, v in enumerate(m_splits):
                if isinstance(v, bool) or isinstance(v, torch.Tensor):
                    bad = True
                else:
                    try:
                        v = operator.index(v)
                        bad = False
                    except TypeError:
                        bad = True
                if bad:
                    raise TypeError(
                        f"GroupedLinear.forward(m_splits=...): element {i} is {v!r} "
                        f"({type(v).__name__}); expected {accepted}"
                    )
                values.append(v)
            splits = tuple(values)
        else:
            raise TypeError(
                f"GroupedLinear.forward(m_splits=...) must be {accepted}, got "
                f"{type(m_splits).__name__}"
            )
        if len(splits) != self.num_experts:
            raise ValueError(
                f"GroupedLinear.forward(m_splits=...) has {len(splits)} entries {list(splits)}; "
                f"expected one per expert ({self.num_experts})"
            )
        if any(m < 0 for m in splits):
            raise ValueError(
                f"GroupedLinear.forward(m_splits=...) must be >= 0 everywhere, got {list(splits)}"
            )
        if sum(splits) != rows:
            raise ValueError(
                f"GroupedLinear.forward(m_splits=...) sums to {sum(splits)} ({list(splits)}), "
                f"but x has {rows} rows; m_splits[i] is the number of consecutive rows of x "
                "routed to expert i, so they must add up to x.shape[0]"
            )
        return splits

    def forward(self, x: torch.Tensor, m_splits: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Apply expert i to the i-th group of ``m_splits[i]`` rows of ``x``.

        Args:
            x: [sum(m_splits), in_features] input, rows grouped by expert.
            m_splits: rows per expert: a list/tuple of ints or a 1-D integer CPU tensor,
                with one entry per expert, each >= 0, summing to ``x.shape[0]``.

        Returns:
            [sum(m_splits), out_features] output, rows in the order of ``x``.

        Raises:
            TypeError: ``x`` is not a tensor; ``m_splits`` has the wrong type, a non-int
                element, or is a tensor on an accelerator (reading it would force a host
                sync).
            ValueError: ``x`` is not 2-D with ``in_features`` columns; ``m_splits`` has
                the wrong length, a negative entry, or does not sum to ``x.shape[0]``.
            RuntimeError: fusion is on and a weight has no ``main_grad`` (see
                ``offload.main_grad.attach``).
        """
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"GroupedLinear.forward(x=...) must be a torch.Tensor, got {type(x).__name__}"
            )
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"GroupedLinear.forward(x=...) must have shape [tokens, {self.in_features}], "
                f"got {tuple(x.shape)}; flatten the leading dimensions first"
            )
        splits = self._splits(m_splits, x.shape[0])
        weights = [getattr(self, f"weight{i}") for i in range(self.num_experts)]
        biases = (
            [getattr(self, f"bias{i}") for i in range(self.num_experts)] if self.use_bias else []
        )
        fuse = self.fuse_wgrad_accumulation and torch.is_grad_enabled()
        fsdp_params = None
        if fuse:
            if self._fsdp_wgrad:
                fsdp_params = tuple(
                    self._fsdp_wgrad.get(f"weight{i}") for i in range(self.num_experts)
                )
            for i, w in enumerate(weights):
                has_fsdp = fsdp_params is not None and fsdp_params[i] is not None
                if w.requires_grad and not has_fsdp:
                    require_main_grad(w, self._describe(), f"weight{i}")
        return _GroupedLinearFunction.apply(
            x, splits, fuse, fsdp_params, self._describe(), self.use_bias, *weights, *biases
        )

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.use_bias}, "
            f"fuse_wgrad_accumulation={self.fuse_wgrad_accumulation}"
        )
