"""Attaching an offloader to a model's forward: :class:`AttachHandle` (the hooks that
enter and leave the offloader around each forward) and ``_ModuleHook``, the hook object
the offloader puts on modules (inert in copies of the module, eager under dynamo)."""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from offload._core import _dynamo

if TYPE_CHECKING:
    from offload.activations._offloader import ActivationOffloader

__all__ = ["AttachHandle", "LayerHooks"]


def attach(offloader: ActivationOffloader, model: torch.nn.Module) -> AttachHandle:
    """``offloader.attach(model)`` (its docstring says what it does)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"attach() takes the nn.Module whose forward runs the layers; got "
            f"{type(model).__name__}"
        )
    # Weak references: the model's hooks keep a handle alive, and a strong reference
    # back from the offloader would make a cycle only the garbage collector frees.
    attachments: list[weakref.ref[AttachHandle]] = offloader.__dict__.setdefault("_attachments", [])
    attachments[:] = [r for r in attachments if r() is not None]
    for ref in attachments:
        other = ref()
        if other is not None and other.model is model:
            raise ValueError(
                f"this {type(model).__name__} is already attached to this offloader; "
                f"call remove() on the first handle (or offloader.detach()) before "
                f"attaching it again"
            )
    handle = AttachHandle(offloader, model)
    attachments.append(weakref.ref(handle))
    return handle


def detach(offloader: ActivationOffloader) -> None:
    """``offloader.detach()``: ``remove()`` on each of its live attachments."""
    for ref in list(offloader.__dict__.get("_attachments", ())):
        handle = ref()
        if handle is not None:
            handle.remove()


class LayerHooks:
    """The offloader's two hooks on each of its layers: a forward pre-hook and a forward
    hook. ``with offloader:`` registers them at entry and removes them at exit (nothing
    of the offloader stays on the modules); while the offloader is attached to a model
    they stay registered between forwards (outside a forward they return at once),
    which takes their registration off the step's start. They are made from the bound
    methods at each registration, so this object holds no reference to the offloader.

    A forward expected to offload nothing registers them on its first layer only
    (``partial``); :meth:`add_rest` registers the others when it turns out to offload
    (Note [untracked calls] in ``offload/activations/_layer_calls.py``).
    """

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        self._modules = list(dict.fromkeys(layers))  # each module once, in order
        self._handles: list[Any] = []
        #: the hook objects registered, for add_rest()
        self._hooks: tuple[_ModuleHook, _ModuleHook] | None = None
        #: registered on one module only (``_first``)
        self.partial = False
        self._first: torch.nn.Module | None = None
        #: attachments that keep the hooks registered between forwards
        self._holders = 0

    def add(
        self,
        start: Callable[..., None],
        end: Callable[..., None],
        first: torch.nn.Module | None = None,
    ) -> None:
        """Register the hooks (``start`` before each layer, ``end`` after it) on every
        layer, or on ``first`` alone; nothing when they are registered already."""
        if self._handles:
            return
        # one hook object of each kind for every module: it holds nothing per module
        self._hooks = (_ModuleHook(start, arity=3), _ModuleHook(end, arity=4))
        if first is not None and any(m is first for m in self._modules):
            self._first = first
            self._register([first])
            self.partial = True
        else:
            self._register(self._modules)

    def add_rest(self) -> None:
        """Register the hooks on the layers :meth:`add` left out (``first`` given)."""
        if self.partial:
            self.partial = False
            first = self._first
            self._register([m for m in self._modules if m is not first])

    def _register(self, modules: list[torch.nn.Module]) -> None:
        before, after = self._hooks  # type: ignore[misc]
        for module in modules:
            self._handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            self._handles.append(module.register_forward_hook(after, with_kwargs=True))

    def release(self) -> None:
        """A forward ended: remove the hooks unless an attachment holds them."""
        if not self._holders:
            self.remove()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._hooks = None
        self.partial = False
        self._first = None

    def hold(
        self, hold: bool, start: Callable[..., None], end: Callable[..., None], idle: bool
    ) -> None:
        """An attachment starts (``hold``) or stops keeping the hooks registered; the
        last one to stop removes them when no forward is running (``idle``; else the
        forward's exit does)."""
        if hold:
            self._holders += 1
            self.add(start, end)
            self.add_rest()
            return
        self._holders -= 1
        if not self._holders and idle:
            self.remove()


class AttachHandle:
    """What :meth:`ActivationOffloader.attach` returns: the two hooks on the model.

    ``remove()`` takes them off (idempotent); as a context manager, the block's end
    removes them. ``model`` is the attached module (``None`` once it was garbage
    collected), ``removed`` whether :meth:`remove` ran. Copies of the model
    (``copy.deepcopy``, pickling) are not attached: their copies of the hooks do nothing.

    Args:
        offloader: the :class:`ActivationOffloader` entered around each forward.
        model: the module whose forward runs the offloader's layers.

    Made by :meth:`ActivationOffloader.attach`, which checks its arguments (its
    ``Raises`` apply); this constructor raises nothing of its own.

    Example:
        >>> import offload
        >>> layers = [torch.nn.Linear(512, 512) for _ in range(2)]
        >>> offloader = offload.ActivationOffloader(layers, min_tensor_bytes=0)
        >>> with offloader.attach(torch.nn.Sequential(*layers)) as handle:
        ...     handle.removed
        False
        >>> handle.removed
        True
    """

    def __init__(self, offloader: ActivationOffloader, model: torch.nn.Module) -> None:
        self._offloader = offloader
        self._model = weakref.ref(model)
        self.removed = False
        # Per thread: one frame per call of the model in flight, (entered, exception
        # being handled when the call started); the outermost call that found the
        # offloader free enters it, nested calls only push a frame.
        self._local = threading.local()
        start = _ModuleHook(self._forward_start, traced=self._forward_start_compiled)
        self._hooks = [
            model.register_forward_pre_hook(start, prepend=True),
            model.register_forward_hook(_ModuleHook(self._forward_end), always_call=True),
        ]
        offloader._hold_layer_hooks(True)
        if _compiled_whole(model):
            self._warn_compiled()

    def _warn_compiled(self) -> None:
        """Say once that the attached model is compiled as a whole (docs/compile.md)."""
        self._offloader._warn_once("whole_model_compile", _WHOLE_MODEL_COMPILED)

    def _forward_start_compiled(self, module: torch.nn.Module, args: Any) -> None:
        """``_forward_start`` called from a frame dynamo compiled: the model's forward
        (or a module around it) is compiled as a whole."""
        self._warn_compiled()
        self._forward_start(module, args)

    @property
    def model(self) -> torch.nn.Module | None:
        return self._model()

    def _frames(self) -> list[tuple[bool, BaseException | None]]:
        frames = getattr(self._local, "frames", None)
        if frames is None:
            frames = self._local.frames = []
        return frames

    def _forward_start(self, module: torch.nn.Module, args: Any) -> None:
        frames = self._frames()
        off = self._offloader
        # sys.exc_info() here is an exception the *caller* is handling (a forward run
        # inside an `except` block); _forward_end must not take it for the forward's own
        frames.append((False, sys.exc_info()[1]))
        if off._step is None and torch.is_grad_enabled():
            off.__enter__()
            frames[-1] = (True, frames[-1][1])

    def _forward_end(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        frames = self._frames()
        if not frames:  # a global pre-hook raised before ours ran
            return
        entered, outer = frames.pop()
        off = self._offloader
        if not entered or off._step is None:
            return
        exc_type, exc, tb = sys.exc_info()
        if exc is None or exc is outer:
            off.__exit__(None, None, None)
        else:  # called by always_call: the forward (or a hook before ours) raised
            off.__exit__(exc_type, exc, tb)

    def remove(self) -> None:
        """Remove the hooks from the model. Idempotent.

        Removing them while a forward they entered has not returned (from inside that
        forward, or after a ``KeyboardInterrupt``, which module hooks do not see) leaves
        the context as an exception would: what that forward offloaded is freed.
        """
        if self.removed:
            return
        self.removed = True
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._offloader._hold_layer_hooks(False)
        attachments = self._offloader.__dict__.get("_attachments", [])
        attachments[:] = [r for r in attachments if r() is not None and r() is not self]
        frames = self._frames()
        entered = any(e for e, _ in frames)
        frames.clear()
        if entered and self._offloader._step is not None:
            error = RuntimeError(
                "offload: the attachment was removed while a forward it entered was running"
            )
            self._offloader.__exit__(RuntimeError, error, None)

    def __enter__(self) -> AttachHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        model = self.model
        name = "<collected>" if model is None else type(model).__name__
        state = "removed" if self.removed else "attached"
        return f"AttachHandle({name}, {state})"


_WHOLE_MODEL_COMPILED = (
    "offload: the model this offloader is attached to is compiled as a whole "
    "(torch.compile(model) or model.compile()), which offloading does not cover: dynamo "
    "compiles the code between the layers with them and less is offloaded than when "
    "the model runs eagerly. Compile the layers one by one instead (layer.compile(); "
    "docs/compile.md)."
)


def _compiled_whole(model: torch.nn.Module) -> bool:
    """``model`` is a ``torch.compile`` wrapper or was compiled by ``model.compile()``
    (a wrapper exists only once dynamo is imported: no import here)."""
    frame = sys.modules.get("torch._dynamo.eval_frame")
    wrapped = frame is not None and isinstance(model, frame.OptimizedModule)
    return wrapped or getattr(model, "_compiled_call_impl", None) is not None


#: torch.compiler.is_compiling, read twice per layer call (dynamo knows the function
#: itself, whatever name calls it: True while it traces)
_is_compiling = torch.compiler.is_compiling


class _ModuleHook:
    """One hook the offloader puts on a module (an attachment's, or a layer's). A copy
    of the module (``copy.deepcopy``: reference or EMA models; pickling) gets an inert
    hook instead of a copy of the offloader."""

    __slots__ = ("arity", "fn", "traced")

    def __init__(
        self,
        fn: Callable[..., None] | None,
        arity: int = 0,
        traced: Callable[..., None] | None = None,
    ) -> None:
        #: a bound method (of the offloader or of an attachment), or None (inert)
        self.fn = fn
        #: the number of arguments torch passes this hook as registered (0: any). Torch
        #: registers a hook and marks it ``with_kwargs`` in two steps, and removes it in
        #: two: a forward running on another thread in between calls it with the other
        #: arity. That thread never owns the offloader (its owner registers and removes on
        #: its own thread), so such a call has nothing to do.
        self.arity = arity
        #: what a frame compiled by dynamo calls instead (``layer.compile()`` compiles
        #: the module's hooks with its forward), with ``fn.__self__`` first: ``fn``'s
        #: function, run eagerly, outside the graph (one wrapper per function, shared);
        #: ``traced``, a method of the same object, instead when given
        self.traced = None if fn is None else _dynamo.eager_function(traced or fn)

    def __call__(self, *args: Any) -> None:
        fn = self.fn
        if fn is not None and (not self.arity or len(args) == self.arity):
            if _is_compiling():
                self.traced(fn.__self__, *args)  # type: ignore[misc, attr-defined]
            else:
                fn(*args)  # without the eager wrapper's cost (about a microsecond)

    def __deepcopy__(self, memo: Any) -> _ModuleHook:
        return _ModuleHook(None)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_ModuleHook, (None,))
