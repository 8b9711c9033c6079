"""The control of an :class:`~offload.ActivationOffloader` that the tools measuring it use
(``offload.profile_step``, the planner, the TransformerEngine API) and the white-box
tests: every access to its private state from outside ``offload.activations`` goes
through here, so a rename needs one change."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["Internals", "current_pack", "running_step"]


def running_step(offloader: Any) -> Any:
    """The step object of the forward ``offloader`` is running now, or ``None``."""
    return offloader._step


def current_pack(offloader: Any) -> Callable[[torch.Tensor], Any] | None:
    """The pack hook of the forward ``offloader`` is running now, or ``None`` outside
    one: the planner's selective levers hand it the outputs they keep."""
    step = running_step(offloader)
    return None if step is None else step.pack


class Internals:
    """The measuring tools' and white-box tests' access to an offloader's private state
    (users read :attr:`~offload.ActivationOffloader.last_step` and ``stats`` instead).

    * :attr:`layers`: the registered layer modules, in order;
    * :meth:`timing_on`: the offloader's own settings plus ``timing=True`` for the
      steps made meanwhile (see its docstring);
    * :meth:`disabled`: ``with offloader:`` does nothing at all meanwhile;
      :attr:`is_disabled`: whether that is so now;
    * :meth:`last_step` and :meth:`copy_records`: the most recent forward and its
      timing records; :meth:`current_step`, :meth:`next_step` and
      :meth:`unfinished_steps`: the forward running, the one prepared for the next
      forward, the forwards whose backward has not ended (compared by identity);
    * :attr:`runtime`: the device side (streams, host pool, graph-bound blocks);
    * :attr:`auto_policy` and :meth:`use_meter`: the ``"auto"`` policy, and how it
      measures (the host clock on a CPU, a scripted meter in tests).
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

    @property
    def is_disabled(self) -> bool:
        """Whether :meth:`disabled` is in force."""
        return bool(self.off._disabled)

    def last_step(self) -> Any:
        """The object of the most recent forward (compared by identity only)."""
        return self.off._last

    def current_step(self) -> Any:
        """The object of the forward running now, or ``None``."""
        return running_step(self.off)

    def next_step(self) -> Any:
        """The object prepared at the end of a forward for the next one, or ``None``."""
        return self.off._next

    def unfinished_steps(self) -> list[Any]:
        """The forwards whose backward has not ended, oldest first."""
        return list(self.off._unfinished)

    @property
    def runtime(self) -> Any:
        """The offloader's :class:`~offload._core._runtime.Runtime`."""
        return self.off._runtime

    @property
    def auto_policy(self) -> Any:
        """The :class:`~offload.activations._auto._policy.AutoPolicy` of an ``"auto"``
        offloader.

        Raises:
            ValueError: the offloader's ``offload_layers`` is not ``"auto"``.
        """
        policy = self.off._auto
        if policy is None:
            raise ValueError(
                f"the offloader has no auto policy: offload_layers="
                f"{self.off.config.offload_layers!r}, not 'auto'"
            )
        return policy

    def use_meter(self, meter: Any) -> None:
        """Have the ``"auto"`` policy measure with ``meter`` (a
        :class:`~offload.activations._auto._probe.Meter`) instead of the device's own:
        ``Meter()`` times the CPU path with the host clock; tests script one.

        Raises:
            ValueError: the offloader is not ``"auto"``.
        """
        self.auto_policy.meter = meter

    def copy_records(self) -> list[tuple[int, tuple[Any, ...]]]:
        """``[(group index, record), ...]`` of the most recent forward, each record
        ``(kind, start_event, end_event)`` (CUDA) or ``(kind, seconds)`` (synchronous
        path), ``kind`` in ``d2h``/``h2d``/``stall``."""
        step = self.off._last
        if step is None:
            return []
        return [(g.index, rec) for g in step.groups for rec in (g.times or ())]
