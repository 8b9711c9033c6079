"""Where our code meets ``torch.compile``: entry points that dynamo must not trace.

A layer compiled on its own (``layer.compile()``, which compiles ``nn.Module._call_impl``
with the module's hooks, or ``torch.compile(layer)``) calls the offloader's module hooks
from inside the compiled frame. Traced, they would run on fake tensors (data pointers,
storage offsets and byte counts do not exist there) and bake the offloader's Python state
into the graph. :func:`eager` makes such an entry point an opaque boundary: dynamo stops
its graph at the call (a graph break), runs the function as ordinary Python, and
compiles what follows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["eager", "eager_method"]

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
    return torch.compiler.disable(fn, recursive=True)  # type: ignore[return-value]


#: method function -> its eager wrapper (methods of a few classes: bounded)
_EAGER_METHODS: dict[Any, Callable[..., Any]] = {}


def eager_method(fn: Callable[..., Any]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """:func:`eager` of a bound method's function, made once per function, and the
    leading arguments to call it with (``(fn.__self__,)``): hooks are registered at
    every ``with offloader:`` and wrapping costs far more than a call (about 150 us on
    a CPU host). Other callables are wrapped each time (no leading arguments)."""
    func, owner = getattr(fn, "__func__", None), getattr(fn, "__self__", None)
    if func is None or owner is None:
        return eager(fn), ()
    wrapped = _EAGER_METHODS.get(func)
    if wrapped is None:
        wrapped = _EAGER_METHODS[func] = eager(func)
    return wrapped, (owner,)
