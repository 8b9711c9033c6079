"""Where our code meets ``torch.compile``: entry points that dynamo must not trace.

A layer compiled on its own (``layer.compile()``, which compiles ``nn.Module._call_impl``
with the module's hooks, or ``torch.compile(layer)``) calls the offloader's module hooks
from inside the compiled frame. Traced, they would run on fake tensors (data pointers,
storage offsets and byte counts do not exist there) and bake the offloader's Python state
into the graph. :func:`eager` makes such an entry point an opaque boundary: dynamo stops
its graph at the call (a graph break), runs the function as ordinary Python, and
compiles what follows.

Saved-tensor hooks are another way in: autograd calls them from C++ while an operation
runs, and an operation that runs eagerly inside a compiled frame's call (a frame that
dynamo gave up on or broke, with its frame callback still set) would hand dynamo the
hook's frame to compile (``InternalTorchDynamoError`` on ``t.__dict__``). Such a hook
runs on real tensors and never belongs in a graph: :func:`opaque` marks its code so
dynamo skips its frame and every frame it calls, at no cost per call.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["eager", "eager_function", "opaque"]

F = TypeVar("F", bound=Callable[..., Any])


def eager(fn: F) -> F:
    """``fn`` run eagerly, never traced by dynamo (``torch.compiler.disable``); calls it
    makes are not compiled either.

    Importing dynamo costs about as much as importing torch, so wrap at the time the
    function is handed to torch (a hook registered, an offloader made), not at import.
    The wrapper costs about a microsecond per call (it switches dynamo's frame callback
    off and on), so a hot hook keeps both and picks at call time; dynamo evaluates
    ``torch.compiler.is_compiling()`` as True while it traces::

        def __call__(self, *args):
            if torch.compiler.is_compiling():
                return self.traced(*args)  # eager(fn): a graph break, fn runs eagerly
            return self.fn(*args)

    ``torch.compiler.disable(fn, recursive=True)`` behaves the same in torch 2.11 and
    2.13 (checked on 2.13 CPU; the GPU machine's 2.11 runs tests/test_real_world_cuda.py).
    """
    return torch.compiler.disable(fn, recursive=True)


#: function -> eager(function), made once per function (eager_function)
_EAGER: dict[Callable[..., Any], Callable[..., Any]] = {}


def eager_function(method: Callable[..., Any]) -> Callable[..., Any]:
    """``eager(method.__func__)``, made once per function and shared: call it with
    ``method.__self__`` first. Hooks registered at every forward (the offloader's layer
    hooks) take theirs from here: a ``torch.compiler.disable`` wrapper made per hook and
    registration costs more host time than the forward's hooks themselves."""
    func = method.__func__  # type: ignore[attr-defined]
    traced = _EAGER.get(func)
    if traced is None:
        traced = _EAGER[func] = eager(func)
    return traced


def _code_of(fn: Callable[..., Any]) -> types.CodeType:
    func = getattr(fn, "__func__", fn)  # a bound method: its function
    return func.__code__


def opaque(fn: F) -> F:
    """``fn`` with its code marked for dynamo: a frame of it (and every frame it calls)
    always runs as ordinary Python, even when dynamo's frame callback is set, so the
    function itself is returned and a call costs nothing more. For entry points that
    torch calls on real tensors outside any trace (saved-tensor hooks): dynamo traces
    no call of ``fn`` into a graph, but must not compile its frame either.

    The marking is per code object, so marking a method once covers every instance.
    Torch without ``set_code_exec_strategy`` (older than 2.6's successors that have
    it) gets :func:`eager` instead: a wrapper, about a microsecond per call.
    """
    try:
        from torch._C._dynamo.eval_frame import (
            _FrameAction,
            _FrameExecStrategy,
            set_code_exec_strategy,
        )
    except ImportError:  # pragma: no cover - torch without per-code strategies
        return eager(fn)
    skip = _FrameAction.SKIP
    set_code_exec_strategy(_code_of(fn), _FrameExecStrategy(skip, skip))
    return fn
