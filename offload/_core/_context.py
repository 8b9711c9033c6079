"""Which offload context is entered on each thread: one at a time, because saved-tensor
hooks do not nest (only the innermost pair sees tensors, so a second context inside a
first would leave the outer one silently empty), and each context on one thread at a time
(its forward's state is one: a second thread entering it would replace the first
thread's step mid-forward)."""

from __future__ import annotations

import threading

__all__ = ["active", "claim", "owner", "release"]


class _Active(threading.local):
    #: the context entered on this thread (a class default: a missing attribute of a
    #: threading.local costs an exception on every lookup)
    owner: object | None = None


#: ``owner``: the context entered on this thread (hot paths read it without a call)
active = _Active()

#: id(context) -> the ident of the thread that entered it (claim and release, under _lock)
_threads: dict[int, int] = {}
_lock = threading.Lock()


def owner() -> object | None:
    """The offload context entered on this thread, or ``None``."""
    return active.owner


def claim(context: object, what: str) -> None:
    """Record ``context`` as the one entered on this thread.

    Raises:
        RuntimeError: ``context`` or another context is already entered on this thread,
            or ``context`` is entered by another thread.
    """
    current = owner()
    if current is context:
        raise RuntimeError(
            f"this {what} is already entered on this thread; nested `with` blocks of the "
            f"same offloader are not supported (exit the first one before entering again)"
        )
    if current is not None:
        raise RuntimeError(
            f"another offload context ({type(current).__name__}) is already active on this "
            f"thread. Saved-tensor hooks do not nest (only the innermost would see the "
            f"tensors and the outer one would silently offload nothing): use one "
            f"ActivationOffloader over all the layers and choose with offload_layers"
        )
    me = threading.get_ident()
    with _lock:
        other = _threads.get(id(context))
        if other is not None and other != me and _alive(other):
            raise RuntimeError(
                f"this {what} is already entered by another thread (ident {other}); one "
                f"offloader is entered by one thread at a time. Give each thread its own "
                f"offloader (several may share the same layers), or wait for the other "
                f"thread to leave its `with` block"
            )
        _threads[id(context)] = me
    active.owner = context


def release(context: object) -> None:
    """Forget ``context`` if it is the one entered on this thread."""
    if owner() is context:
        active.owner = None
        with _lock:
            if _threads.get(id(context)) == threading.get_ident():
                del _threads[id(context)]


def _alive(ident: int) -> bool:
    """Whether a thread of this ident is still running (a thread that ended inside a
    context never released it, and its context's id may since have been reused)."""
    return any(t.ident == ident for t in threading.enumerate())
