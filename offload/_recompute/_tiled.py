"""Sequence-tiled recompute for position-wise blocks (a decoder layer's MLP).

In a long-sequence step, one layer's MLP holds ``tokens x ffn`` intermediates (its
up/gate projections and their product) for the backward, or, under checkpointing, during
the layer's recomputation: at 64k tokens and ffn 14,336 in bf16 each is 1.75 GiB.
Because the MLP treats every token on its own, :func:`tile_mlp` runs it a tile of the
sequence at a time with no autograd graph, keeping only its input; the backward
recomputes each tile with autograd and accumulates the input's and the parameters'
gradients. The result equals the plain MLP's up to float summation order (the parameter
gradients are sums over tiles, accumulated in fp32).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from offload._layers import find_layers

__all__ = ["TiledHandle", "tile_mlp"]

#: Tiles no shorter than this many tokens under ``tile_tokens="auto"``: shorter tiles
#: leave the matmuls too small to run at speed.
_AUTO_MIN_TOKENS = 1024


def _device_states(x: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The CPU RNG state and the input device's (``None`` on the CPU)."""
    cpu = torch.get_rng_state()
    if x.device.type == "cuda":
        return cpu, torch.cuda.get_rng_state(x.device)
    return cpu, None


def _concat(parts: list[Any], dim: int, fn: Callable[..., Any]) -> torch.Tensor:
    """The tiles' outputs joined along the sequence; a module that returns something
    other than one tensor (an MoE block's router logits beside it) cannot be tiled."""
    if not all(isinstance(p, torch.Tensor) for p in parts):
        owner = getattr(fn, "__self__", fn)
        raise TypeError(
            f"tile_mlp tiles modules whose forward returns one tensor; "
            f"{type(owner).__name__} returned {type(parts[0]).__name__}"
        )
    return torch.cat(parts, dim)


# Note [tiled input first]
# A tiled call keeps only its input for the backward. If the call itself saved it, the
# save would be packed when its forward returns, after the tiles ran; under a
# non-reentrant checkpoint (torch's, :func:`offload.checkpoint`, Hugging Face's) the
# recomputation for the backward would then run every tile once more, only to reach
# that save, and the backward would run them a third time. So the input is saved by an
# identity node of its own (:class:`_KeepInput`) called just before: when that save is
# the last of the checkpointed region (a decoder layer ends in its MLP and a residual
# add, which saves nothing), the checkpoint's early stop ends the recomputation there,
# and the MLP's forward runs twice in all (forward, backward), as without tiling. The
# tiled node reads the input from the identity node's saved tensors in its backward,
# which runs before the identity node's (autograd frees those only after that).


class _KeepInput(torch.autograd.Function):
    """Identity that saves its input for the tiled call after it (Note [tiled input first])."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _TiledCall(torch.autograd.Function):
    """``fn`` over tiles of the sequence: forward without a graph, backward by tile."""

    @staticmethod
    def forward(
        ctx: Any,
        fn: Callable[[torch.Tensor], torch.Tensor],
        tile: int,
        dim: int,
        keep: Any,
        x: torch.Tensor,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        ctx.fn, ctx.tile, ctx.dim, ctx.params, ctx.keep = fn, tile, dim, params, keep
        # The backward replays the tiles in the same order from the same RNG state, so a
        # dropout inside (a LoRA adapter's) draws the same masks.
        ctx.rng = _device_states(x)
        ctx.autocast = (
            torch.is_autocast_enabled(x.device.type),
            torch.get_autocast_dtype(x.device.type),
        )
        if keep is None:  # x needs no gradient: no identity node went before
            ctx.save_for_backward(x)
        with torch.no_grad():
            out = _concat([fn(part.contiguous()) for part in x.split(tile, dim)], dim, fn)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors if ctx.keep is None else ctx.keep.saved_tensors
        params = [p for p, need in zip(ctx.params, ctx.needs_input_grad[5:]) if need]
        need_x = ctx.needs_input_grad[4]
        grad_x: Any = torch.empty_like(x) if need_x else None
        # fp32 sums: the plain MLP forms each parameter gradient in one matmul (fp32
        # accumulation inside); a per-tile sum in bf16 would round once per tile.
        sums = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in params]
        cpu_state, dev_state = ctx.rng
        devices = [x.device] if dev_state is not None else []
        enabled, dtype = ctx.autocast
        with torch.random.fork_rng(devices=devices, device_type=x.device.type):
            torch.set_rng_state(cpu_state)
            if dev_state is not None:
                torch.cuda.set_rng_state(dev_state, x.device)
            offset = 0
            for part, g in zip(x.split(ctx.tile, ctx.dim), grad_out.split(ctx.tile, ctx.dim)):
                # contiguous as in the forward (a tile of a batch > 1 is a strided view,
                # which modules that .view() their input reject)
                leaf = part.detach().contiguous().requires_grad_(need_x)
                with torch.enable_grad(), torch.autocast(x.device.type, dtype, enabled=enabled):
                    out = ctx.fn(leaf)
                wrt = ([leaf] if need_x else []) + params
                grads = torch.autograd.grad(out, wrt, g, allow_unused=True)
                if need_x:
                    grad_x.narrow(ctx.dim, offset, part.shape[ctx.dim]).copy_(grads[0])
                    grads = grads[1:]
                for total, grad in zip(sums, grads):
                    if grad is not None:
                        total += grad
                offset += part.shape[ctx.dim]
        out_grads = iter(s.to(p.dtype) for s, p in zip(sums, params))
        param_grads = [next(out_grads) if need else None for need in ctx.needs_input_grad[5:]]
        return (None, None, None, None, grad_x, *param_grads)


def _tiled_forward(
    handle: TiledHandle, module: nn.Module, original: Callable[..., Any]
) -> Callable[..., Any]:
    @functools.wraps(original)
    def tiled_forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or not isinstance(x, torch.Tensor) or x.dim() < 2:
            return original(x, *args, **kwargs)  # not the one-tensor call tiling handles
        dim = x.dim() - 2  # the sequence: (..., seq, hidden)
        tile = handle.tile_size(x)
        if x.shape[dim] <= tile:
            return original(x)
        params = [p for p in module.parameters() if p.requires_grad]
        if not torch.is_grad_enabled() or not (x.requires_grad or params):
            with torch.no_grad():  # tiles cut the peak without a graph too
                parts = [original(part.contiguous()) for part in x.split(tile, dim)]
                return _concat(parts, dim, original)
        handle.calls += 1
        keep = None
        if x.requires_grad:  # Note [tiled input first]
            x = _KeepInput.apply(x)
            keep = x.grad_fn
        return _TiledCall.apply(original, tile, dim, keep, x, *params)

    tiled_forward._offload_tiled = True  # type: ignore[attr-defined]
    return tiled_forward


class TiledHandle:
    """What :func:`tile_mlp` returns.

    ``remove()`` restores every module's ``forward`` (idempotent; also the end of a
    ``with`` block).

    Attributes:
        modules: the modules tiled (the MLPs), in order.
        tile_tokens: tokens per tile, an int or ``"auto"``.
        calls: how many tiled calls built a backward (a count across modules).
        removed: whether :meth:`remove` ran.
    """

    def __init__(self, modules: list[nn.Module], tile_tokens: int | str) -> None:
        self._refs = [weakref.ref(m) for m in modules]
        self.tile_tokens = tile_tokens
        self.calls = 0
        self.removed = False
        self._swapped: list[tuple[nn.Module, Any, Any]] = []

    @property
    def modules(self) -> list[nn.Module]:
        """The tiled modules still alive."""
        return [m for m in (r() for r in self._refs) if m is not None]

    def tile_size(self, x: torch.Tensor) -> int:
        """Tokens per tile for input ``x``: ``tile_tokens``, or under ``"auto"`` the
        input's width (at least 1024), so that a tile's ``tile x ffn`` intermediate is no
        larger than the MLP's own ``hidden x ffn`` weight (DeepSpeed's ``TiledMLP`` rule).

        Args:
            x: the module's input, ``(..., seq, hidden)``.

        Returns:
            The tile length along the sequence.
        """
        if self.tile_tokens == "auto":
            return max(_AUTO_MIN_TOKENS, int(x.shape[-1]))
        return int(self.tile_tokens)

    def remove(self) -> None:
        """Restore the forward of every module this handle changed."""
        if self.removed:
            return
        self.removed = True
        for module, old, ours in self._swapped:
            if module.__dict__.get("forward") is ours:
                if old is None:
                    del module.forward
                else:
                    module.forward = old
        self._swapped.clear()

    def __enter__(self) -> TiledHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self.removed else f"{len(self.modules)} modules"
        return f"TiledHandle({state}, tile_tokens={self.tile_tokens!r})"


def _targets(model_or_modules: Any, attr: str) -> list[nn.Module]:
    if isinstance(model_or_modules, nn.Module) and not isinstance(
        model_or_modules, (nn.ModuleList, nn.Sequential)
    ):
        layers = find_layers(model_or_modules)
    elif isinstance(model_or_modules, Iterable):
        layers = list(model_or_modules)
    else:
        raise TypeError(
            f"model_or_modules must be an nn.Module or an iterable of modules; got "
            f"{type(model_or_modules).__name__}"
        )
    found = []
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise TypeError(f"element {i} is a {type(layer).__name__}, not an nn.Module")
        child = getattr(layer, attr, None)
        found.append(child if isinstance(child, nn.Module) else layer)
    if not found:
        raise ValueError("no modules to tile: model_or_modules holds none")
    return found


def tile_mlp(
    model_or_modules: nn.Module | Iterable[nn.Module],
    *,
    tile_tokens: int | str = "auto",
    attr: str = "mlp",
) -> TiledHandle:
    """Run position-wise modules (each decoder layer's MLP) a tile of the sequence at a
    time, keeping only their input for the backward.

    Each module's call ``module(x)`` with ``x`` of shape ``(..., seq, hidden)`` and more
    than ``tile_tokens`` positions runs the original forward on tiles of ``x`` along
    ``seq`` under ``no_grad`` and concatenates the outputs; the backward reruns each tile
    with autograd and accumulates the input's gradient (by tile) and the gradients of
    the module's parameters that require grad (summed in fp32 over tiles, then cast:
    frozen base weights get none, LoRA adapters theirs). The RNG state is replayed, so a
    dropout inside draws the same masks. Calls with other arguments, or short inputs,
    run unchanged. The module must be position-wise (each output token depends only on
    the same input token): a Llama/Mistral/Qwen MLP is; an MoE block whose experts have
    a capacity limit is not.

    Memory: the forward's peak is one tile's intermediates, and nothing but the input is
    kept; under checkpointing the recomputed layer keeps only the input too. Time: the
    MLP's forward runs once more (in the backward), like checkpointing it; under a
    non-reentrant checkpoint of a layer that ends in the MLP (a Hugging Face decoder
    layer), the recomputation stops before it, so tiling adds no third run.

    Args:
        model_or_modules: a model (its decoder layers are found with
            :func:`offload.find_layers`, and each one's ``attr`` child is tiled), or an
            iterable of layers (their ``attr`` child) or of the modules themselves.
        tile_tokens: tokens per tile, a positive int, or ``"auto"``: the input's width
            (hidden size), at least 1024, as DeepSpeed's ``TiledMLP`` picks it.
        attr: the child to tile in each layer (``"mlp"`` in Hugging Face decoder layers).
            A layer without it is tiled itself.

    Returns:
        A :class:`TiledHandle`; ``handle.remove()`` restores the modules.

    Raises:
        ValueError: ``tile_tokens`` is not a positive int or ``"auto"``; no modules;
            a module is tiled already.
        TypeError: ``model_or_modules`` is neither a module nor an iterable of modules.

    Example:
        >>> import torch, offload
        >>> mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(),
        ...                           torch.nn.Linear(32, 8))
        >>> x = torch.randn(1, 100, 8, requires_grad=True)
        >>> plain = mlp(x)
        >>> handle = offload.tile_mlp([mlp], tile_tokens=16)
        >>> tiled = mlp(x)
        >>> torch.allclose(tiled, plain, atol=1e-6)
        True
        >>> tiled.sum().backward()
        >>> handle.remove()
    """
    ok = tile_tokens == "auto" or (
        isinstance(tile_tokens, int) and not isinstance(tile_tokens, bool) and tile_tokens > 0
    )
    if not ok:
        raise ValueError(
            f"tile_tokens must be a positive int (sequence positions per tile) or 'auto'; "
            f"got {tile_tokens!r}"
        )
    modules = _targets(model_or_modules, attr)
    for module in modules:
        if getattr(module.__dict__.get("forward"), "_offload_tiled", False):
            raise ValueError(f"{type(module).__name__} is tiled already; remove() its handle first")
    handle = TiledHandle(modules, tile_tokens)
    for module in modules:
        old = module.__dict__.get("forward")
        ours = _tiled_forward(handle, module, module.forward)
        module.forward = ours
        handle._swapped.append((module, old, ours))
    return handle
