"""The full recompute of the ``checkpoint`` and ``checkpoint_offload`` levers, torch's
reentrant scheme (``recompute="reentrant"``).

Note [full recompute]
~~~~~~~~~~~~~~~~~~~~~
Torch's non-reentrant checkpoint builds the layer's autograd graph in the forward, runs a
Python hook for each tensor the layer saves there, and again for each in the recompute.
On a model whose step the host paces (a decoder layer of Hugging Face Llama saves about
40 tensors) that machinery costs more host time than the recompute costs the device, and
the device waits. The reentrant scheme has none of it, but recomputes the whole forward,
where torch's non-reentrant recompute stops once it has every saved tensor (it skips the
layer's last operations, a residual stream's output projection among them): on a step
the device paces that is the slower of the two. Neither wins everywhere, so
:func:`offload.plan` measures both (``RECOMPUTES``). The reentrant scheme:

1. *Forward.* One autograd Function runs the layer's forward without a graph. Its saved
   tensors are the call's positional tensor arguments (nested in pytree containers too),
   as torch's checkpoint saves them: the offloader's saved-tensor hooks see them
   (``checkpoint_offload`` sends them), and autograd's version counter catches one
   modified in place before the backward. Tensors passed by keyword are held by the
   call, as torch's checkpoint holds them (in a decoder, tables and masks every layer
   shares: sending them would copy the same bytes once per layer). With no argument that requires grad,
   an empty leaf that does still connects the outputs to the graph (the layer's
   parameters need their gradients). The CPU RNG state, that of each CUDA
   device an argument lives on, and the autocast state are recorded.
2. *Backward.* The Function's backward restores them in a forked RNG (the caller's RNG
   is left as it was), runs the forward again with grad enabled on detached arguments,
   and backpropagates the output gradients through that graph with
   ``torch.autograd.backward``: every leaf the layer reads (its parameters or any
   other) accumulates its gradient as in a step without levers, and the arguments'
   gradients are returned to the outer graph. The values are those of the step without
   levers, bit for bit, wherever the layer's kernels are deterministic.
3. *Limits.* A nested backward cannot hand leaf gradients to ``torch.autograd.grad`` or
   to ``backward(inputs=...)``: where such a call reaches the recompute's backward (it
   asks for an argument's gradient) that backward raises :class:`NestedBackwardError`
   (torch's ``_is_checkpoint_valid``), naming the fix; where it asks only for the
   layer's parameters, autograd never runs that backward and they get no gradient (as
   under torch's reentrant checkpoint), which is why :func:`offload.plan` keeps this
   scheme only when every layer parameter's gradient is computed under it as under
   torch's. No graph of the gradients is built (no double backward). While
   ``torch.compile`` traces the layer, torch's non-reentrant checkpoint runs instead
   (the compiler traces it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from offload._core._pytree import join, split

__all__ = ["RECOMPUTES", "NestedBackwardError", "check_recompute", "recompute"]

#: How the full recompute levers recompute a layer: ``"non_reentrant"``, torch's
#: ``torch.utils.checkpoint(use_reentrant=False)``; ``"reentrant"``, :func:`recompute`
#: (Note [full recompute]). :func:`offload.plan` measures both and keeps the faster.
RECOMPUTES = ("non_reentrant", "reentrant")


class NestedBackwardError(RuntimeError):
    """The reentrant recompute reached from ``torch.autograd.grad`` or
    ``backward(inputs=...)`` (Note [full recompute], 3)."""


def check_recompute(value: Any) -> str:
    """``value`` if it is one of :data:`RECOMPUTES`, else ``ValueError`` naming it."""
    if value not in RECOMPUTES:
        raise ValueError(
            f"recompute must be one of {', '.join(map(repr, RECOMPUTES))}; got {value!r}"
        )
    return value


class _Call:
    """What one call's backward needs besides its saved arguments (Note [full
    recompute], 1)."""

    __slots__ = (
        "fn", "args", "kwargs", "saved", "held", "out_spec", "outputs", "cpu_rng", "cuda_rng",
        "autocast", "name",
    )  # fmt: skip

    def __init__(
        self,
        fn: Callable[..., Any],
        specs: tuple[Any, Any],
        leaves: list[torch.Tensor],
        saved: int,
        name: str,
    ):
        self.fn = fn
        self.args, self.kwargs = specs  # of the positional and the keyword arguments
        self.saved = saved  # leaves[:saved] (the positional ones) are saved, the rest held
        self.held: tuple[torch.Tensor, ...] = ()
        self.name = name
        self.out_spec: Any = None
        self.outputs = 0
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng: dict[torch.device, torch.Tensor] = {}
        for t in leaves:
            if t.is_cuda and t.device not in self.cuda_rng:
                self.cuda_rng[t.device] = torch.cuda.get_rng_state(t.device)
        states = [
            (kind, torch.get_autocast_dtype(kind), torch.is_autocast_cache_enabled())
            for kind in ("cpu", "cuda")
            if torch.is_autocast_enabled(kind)
        ]
        self.autocast = states

    def arguments(self, leaves: Sequence[torch.Tensor]) -> tuple[Any, Any]:
        """``(args, kwargs)`` with ``leaves`` in place of the call's tensors."""
        return join(self.args, leaves[: self.saved]), join(self.kwargs, leaves[self.saved :])

    def replay(self) -> contextlib.ExitStack:
        """The RNG (forked) and autocast states of the forward, for the recompute."""
        stack = contextlib.ExitStack()
        devices = list(self.cuda_rng)
        stack.enter_context(torch.random.fork_rng(devices=devices, device_type="cuda"))
        torch.set_rng_state(self.cpu_rng)
        for device, state in self.cuda_rng.items():
            torch.cuda.set_rng_state(state, device)
        enabled = {kind for kind, _, _ in self.autocast}
        for kind, dtype, cache in self.autocast:
            stack.enter_context(torch.autocast(kind, dtype=dtype, cache_enabled=cache))
        for kind in ("cpu", "cuda"):
            if kind not in enabled and torch.is_autocast_enabled(kind):
                stack.enter_context(torch.autocast(kind, enabled=False))
        return stack


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _Call, anchor: Any, *leaves: torch.Tensor) -> Any:
        ctx.call = call
        ctx.save_for_backward(*leaves[: call.saved])
        call.held = leaves[call.saved :]
        args, kwargs = call.arguments(leaves)
        out_spec, outs = split(call.fn(*args, **kwargs))
        call.out_spec, call.outputs = out_spec, len(outs)
        integral = [o for o in outs if not (o.is_floating_point() or o.is_complex())]
        if integral:
            ctx.mark_non_differentiable(*integral)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        call: _Call = ctx.call
        # torch's own reentrant checkpoint asks the same (no public API says whether the
        # running backward accumulates into .grad)
        if not torch.autograd._is_checkpoint_valid():
            raise NestedBackwardError(
                f"offload: the reentrant recompute of layer {call.name} (lever "
                "'checkpoint' or 'checkpoint_offload') runs a nested backward, which "
                "cannot hand leaf gradients to torch.autograd.grad or backward(inputs=...); "
                "call loss.backward() without inputs, or make the plan with "
                "recompute='non_reentrant' (torch's checkpoint)"
            )
        leaves = (*ctx.saved_tensors, *call.held)  # held until the graph is freed
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in leaves]
        args, kwargs = call.arguments(inputs)
        with call.replay(), torch.enable_grad():
            out = call.fn(*args, **kwargs)
        _, outs = split(out)
        if len(outs) != call.outputs:
            raise RuntimeError(
                f"offload: the recompute of layer {call.name} returned {len(outs)} tensors "
                f"where its forward returned {call.outputs}; its forward must compute the "
                "same outputs when run again"
            )
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *[t.grad if t.requires_grad else None for t in inputs])


_ANCHOR: list[torch.Tensor] = []


def _anchor() -> torch.Tensor:
    """An empty CPU leaf that requires grad (one per process; never saved)."""
    if not _ANCHOR:
        _ANCHOR.append(torch.empty(0, requires_grad=True))
    return _ANCHOR[0]


def recompute(fn: Callable[..., Any], name: str, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, its intermediate tensors recomputed in the backward
    (Note [full recompute]). ``name`` names the layer in errors."""
    args_spec, leaves = split(args)
    kwargs_spec, by_keyword = split(kwargs)
    saved = len(leaves)
    leaves += by_keyword
    if torch.compiler.is_compiling() or any(t.device.type not in ("cpu", "cuda") for t in leaves):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    call = _Call(fn, (args_spec, kwargs_spec), leaves, saved, name)
    # with no argument that requires grad, the anchor still connects the outputs to the
    # graph, so that the layer's parameters get their gradients
    anchor = None if any(t.requires_grad for t in leaves) else _anchor()
    outs = _Recompute.apply(call, anchor, *leaves)
    return join(call.out_spec, outs)
