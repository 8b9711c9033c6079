"""Hugging Face models: :func:`offload_checkpointing` (Hugging Face gradient
checkpointing with its inputs in host memory). ``find_layers`` lives in
``offload/_layers.py``; it is importable from here too."""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any

from torch import nn

from offload._layers import find_layers

__all__ = ["CheckpointingHandle", "find_layers", "offload_checkpointing"]


class CheckpointingHandle:
    """What :func:`offload_checkpointing` returns.

    ``remove()`` puts back the checkpoint function each module had before (Hugging
    Face's plain ``torch.utils.checkpoint`` partial): checkpointing stays on, its inputs
    stay on the device again. Idempotent; also the end of a ``with`` block. A module
    whose function was replaced by someone else since is left alone.

    Attributes:
        offloader: the :class:`offload.CheckpointOffloader` in use (stats, ``close()``).
        modules: how many modules got the offloaded checkpoint function.
        removed: whether :meth:`remove` ran.
    """

    def __init__(
        self, offloader: Any, swapped: list[tuple[nn.Module, Any, Any]], model: nn.Module
    ) -> None:
        self.offloader = offloader
        self._swapped = swapped  # (module, original function, ours)
        self._model = weakref.ref(model)
        self.modules = len(swapped)
        self.removed = False

    @property
    def model(self) -> nn.Module | None:
        """The model (``None`` once it was garbage collected)."""
        return self._model()

    def remove(self) -> None:
        """Restore plain checkpointing on every module this handle changed."""
        if self.removed:
            return
        self.removed = True
        for module, original, ours in self._swapped:
            if module.__dict__.get("_gradient_checkpointing_func") is ours:
                module._gradient_checkpointing_func = original
        self._swapped.clear()

    def __enter__(self) -> CheckpointingHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        model = self.model
        name = "<collected>" if model is None else type(model).__name__
        state = "removed" if self.removed else f"{self.modules} modules"
        return f"CheckpointingHandle({name}, {state})"


def offload_checkpointing(
    model: nn.Module,
    gradient_checkpointing_kwargs: dict[str, Any] | None = None,
    *,
    offloader: Any = None,
) -> CheckpointingHandle:
    """Turn a Hugging Face model's gradient checkpointing into offloaded checkpointing.

    Enables non-reentrant gradient checkpointing (``activation_checkpointing_enable`` in
    transformers 5.x, ``gradient_checkpointing_enable`` in 4.x, with
    ``{"use_reentrant": False, **gradient_checkpointing_kwargs}``), then replaces the
    checkpoint function Hugging Face stored on each module
    (``module._gradient_checkpointing_func``, set on every module that has a
    ``gradient_checkpointing`` attribute: the decoder layers, the base model) with
    ``functools.partial(offloader.checkpoint, **kwargs)``. Every checkpointed layer call
    then keeps the hidden states it receives in host memory (see
    :func:`offload.checkpoint`); what Hugging Face binds into the layer function
    (position embeddings, attention mask, passed by keyword) stays on the device.

    Works with transformers 4.46 to 5.x: 5.x checkpoints each ``GradientCheckpointingLayer``'s
    ``forward`` (the module hooks run outside), 4.x its ``__call__`` or the layer call in
    the model's loop; all go through ``_gradient_checkpointing_func``. Call it after
    anything else that enables checkpointing: ``Trainer`` calls
    ``gradient_checkpointing_enable`` itself when ``TrainingArguments(
    gradient_checkpointing=True)``, which would put plain checkpointing back; leave that
    flag ``False`` and call this function instead.

    Args:
        model: a Hugging Face ``PreTrainedModel`` that supports gradient checkpointing.
        gradient_checkpointing_kwargs: keyword arguments for the checkpoint function, as
            in ``gradient_checkpointing_enable`` (``preserve_rng_state``,
            ``determinism_check``, ``context_fn``, ``debug``, ``early_stop``).
            ``use_reentrant`` may only be ``False``. Default ``None``: ``{}``.
        offloader: the :class:`offload.CheckpointOffloader` whose settings, pool and stats
            to use. Default ``None``: the process-wide one of :func:`offload.checkpoint`
            (read its stats with :func:`offload.checkpoint_stats`).

    Returns:
        A :class:`CheckpointingHandle`; ``handle.remove()`` restores plain (non-reentrant)
        checkpointing, which stays enabled.

    Raises:
        TypeError: ``model`` has no ``gradient_checkpointing_enable``, or ``offloader``
            is not a ``CheckpointOffloader``, or ``gradient_checkpointing_kwargs`` is not
            a dict.
        ValueError: ``use_reentrant`` is not ``False``; the model does not support
            gradient checkpointing (from transformers); no module received a checkpoint
            function.

    Example:
        >>> import offload
        >>> from transformers import LlamaConfig, LlamaForCausalLM  # doctest: +SKIP
        >>> model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2))  # doctest: +SKIP
        >>> handle = offload.integrations.hf.offload_checkpointing(model)  # doctest: +SKIP
        >>> model.train()(input_ids, labels=input_ids).loss.backward()  # doctest: +SKIP
        >>> offload.checkpoint_stats().bytes_offloaded > 0  # doctest: +SKIP
        True
    """
    from offload._recompute._checkpoint import CheckpointOffloader, _default_offloader

    if not isinstance(model, nn.Module) or not callable(
        getattr(model, "gradient_checkpointing_enable", None)
    ):
        raise TypeError(
            f"model must be a Hugging Face PreTrainedModel (with gradient_checkpointing_enable); "
            f"got {type(model).__name__}. For your own model call offload.checkpoint(layer, x) "
            f"where you would call torch.utils.checkpoint.checkpoint"
        )
    if gradient_checkpointing_kwargs is None:
        gradient_checkpointing_kwargs = {}
    if not isinstance(gradient_checkpointing_kwargs, dict):
        raise TypeError(
            f"gradient_checkpointing_kwargs must be a dict or None; got "
            f"{type(gradient_checkpointing_kwargs).__name__}"
        )
    kwargs = dict(gradient_checkpointing_kwargs)
    if kwargs.get("use_reentrant", False) is not False:
        raise ValueError(
            f"use_reentrant={kwargs['use_reentrant']!r}: offloaded checkpointing is "
            f"non-reentrant only; drop it or pass use_reentrant=False"
        )
    kwargs["use_reentrant"] = False
    if offloader is None:
        offloader = _default_offloader()
    elif not isinstance(offloader, CheckpointOffloader):
        raise TypeError(
            f"offloader must be an offload.CheckpointOffloader or None; got "
            f"{type(offloader).__name__}"
        )
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers 5.x
    if callable(enable):
        enable(activation_checkpointing_kwargs=dict(kwargs))
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(kwargs))
    ours = functools.partial(offloader.checkpoint, **kwargs)
    swapped = []
    for module in model.modules():
        original = module.__dict__.get("_gradient_checkpointing_func")
        if original is not None:
            module._gradient_checkpointing_func = ours
            swapped.append((module, original, ours))
    if not swapped:
        raise ValueError(
            f"{type(model).__name__}.gradient_checkpointing_enable() set no "
            f"_gradient_checkpointing_func on any module (a model with its own "
            f"checkpointing code?); call offload.checkpoint in its layer loop instead"
        )
    return CheckpointingHandle(offloader, swapped, model)
