"""The control of an :class:`~offload.ActivationOffloader` that the tools measuring it use
(``offload.profile_step``, the planner): every access to its private state from outside
this package goes through here, so that a rename needs one change."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["Internals", "current_pack"]


def current_pack(offloader: Any) -> Callable[[torch.Tensor], Any] | None:
    """The pack hook of the forward ``offloader`` is running now, or ``None`` outside
    one: the planner's selective levers hand it the outputs they keep."""
    step = offloader._step
    return None if step is None else step.pack


class Internals:
    """The profiler's view of an offloader's private state.

    * :attr:`layers`: the registered layer modules, in order;
    * :meth:`timing_on`: the offloader's own settings plus ``timing=True`` for the
      steps made meanwhile (see its docstring);
    * :meth:`disabled`: ``with offloader:`` does nothing at all meanwhile;
    * :meth:`last_step` and :meth:`copy_records`: the most recent forward and its
      timing records.
    """

    def __init__(self, offloader: Any) -> None:
        from offload.activations import ActivationOffloader

        if not isinstance(offloader, ActivationOffloader):
            raise TypeError(
                f"offloader must be an offload.ActivationOffloader; got {type(offloader).__name__}"
            )
        self.off = offloader
        self.layers: list[torch.nn.Module] = list(offloader._layers)

    @contextlib.contextmanager
    def timing_on(self) -> Iterator[None]:
        """Steps made meanwhile record copy and stall times.

        The config is frozen and never changed: a step reads the config of its
        offloader's runtime when it is made, so the runtime (and the offloader, whose
        ``config`` the user reads) gets ``dataclasses.replace(config, timing=True)``
        for the duration, and its own config back afterwards. The step an offloader
        prepares at the end of a forward for the next one was made with the config of
        that moment, so it is dropped at both ends: the first timed step and the user's
        next step after the profile are made with the config in force.
        """
        off = self.off
        old = off.config
        timed = dataclasses.replace(old, timing=True)
        off._next = None
        off.config = off._runtime.config = timed
        try:
            yield
        finally:
            off.config = off._runtime.config = old
            off._next = None

    @contextlib.contextmanager
    def disabled(self) -> Iterator[Callable[[], int]]:
        """``with offloader:`` is a no-op meanwhile (no hooks at all); yields a callable
        returning how many times the context was entered."""
        off = self.off
        old = off._disabled, off._disabled_entries
        off._disabled, off._disabled_entries = True, 0
        try:
            yield lambda: off._disabled_entries
        finally:
            off._disabled, off._disabled_entries = old

    def last_step(self) -> Any:
        """The object of the most recent forward (compared by identity only)."""
        return self.off._last

    def copy_records(self) -> list[tuple[int, tuple[Any, ...]]]:
        """``[(group index, record), ...]`` of the most recent forward, each record
        ``(kind, start_event, end_event)`` (CUDA) or ``(kind, seconds)`` (synchronous
        path), ``kind`` in ``d2h``/``h2d``/``stall``."""
        step = self.off._last
        if step is None:
            return []
        return [(g.index, rec) for g in step.groups for rec in (g.times or ())]
