"""Split a call's arguments or outputs (tensors nested in pytree containers) into its
tensors and a spec, and join new tensors back into the same tree: shared by the
offloaded checkpoint and the recompute levers."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["join", "split"]


def split(tree: Any) -> tuple[Any, list[torch.Tensor]]:
    """The tensors of ``tree`` (nested in pytree containers) and a spec that
    :func:`join` fills with new tensors.

    Plain tuples, lists and dicts (a layer call's arguments and outputs, nearly always)
    are walked here, a few times faster than ``pytree.tree_flatten``, which also leaves
    a reference cycle per call for the collector; a tree holding any other container
    pytree knows (a named tuple, an ``OrderedDict``, a registered class) goes to pytree
    whole, so both give the same leaves."""
    leaves: list[torch.Tensor] = []
    spec = _walk(tree, leaves)
    if spec is not _OTHER:
        return (_PLAIN, spec), leaves
    flat, tree_spec = pytree.tree_flatten(tree)
    where = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    leaves = [flat[i] for i in where]
    for i in where:
        flat[i] = None  # the spec holds no tensor
    return (tree_spec, flat, where), leaves


def join(spec: Any, leaves: Sequence[torch.Tensor]) -> Any:
    """The tree of :func:`split`'s ``spec`` with ``leaves`` in place of its tensors."""
    if spec[0] is _PLAIN:
        return _build(spec[1], iter(leaves))
    tree, flat, where = spec
    flat = list(flat)
    for i, t in zip(where, leaves):
        flat[i] = t
    return pytree.tree_unflatten(flat, tree)


#: markers of :func:`split`'s own specs: a plain tree; a tree pytree must take; a leaf
#: that is no tensor (kept as it is)
_PLAIN, _OTHER, _CONST = object(), object(), object()


def _walk(x: Any, leaves: list[torch.Tensor]) -> Any:
    """The spec of ``x`` (``None`` for a tensor, appended to ``leaves``), or ``_OTHER``."""
    kind = type(x)
    if kind is tuple or kind is list or kind is dict:
        specs = []
        for v in x.values() if kind is dict else x:
            sub = _walk(v, leaves)
            if sub is _OTHER:
                return _OTHER
            specs.append(sub)
        return (kind, list(x) if kind is dict else None, specs)
    if isinstance(x, torch.Tensor):
        leaves.append(x)
        return None
    if kind in pytree.SUPPORTED_NODES or isinstance(x, (tuple, list, dict)):
        return _OTHER
    return (_CONST, x, None)


def _build(spec: Any, tensors: Iterator[torch.Tensor]) -> Any:
    if spec is None:
        return next(tensors)
    kind, body, specs = spec
    if kind is _CONST:
        return body
    if kind is dict:
        return {k: _build(sub, tensors) for k, sub in zip(body, specs)}
    values = [_build(sub, tensors) for sub in specs]
    return values if kind is list else tuple(values)
