"""Layer discovery: :func:`find_layers` names a model's repeated blocks (the layers an
offloader groups by), for Hugging Face models and any other ``nn.Module``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["find_layers"]

#: The container types whose children can be the repeated blocks.
_CONTAINERS: tuple[type[nn.Module], ...] = (nn.ModuleList, nn.Sequential)


def _path(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _display(path: str) -> str:
    return repr(path) if path else "<model>"


def _describe(container: nn.Module) -> str:
    """``'ModuleList of 3: Linear x2, ReLU x1'``."""
    counts = Counter(type(child).__name__ for child in container)
    kinds = ", ".join(f"{name} x{n}" for name, n in counts.items()) or "empty"
    return f"{type(container).__name__} of {len(container)}: {kinds}"


#: What :func:`_walk` decided about one container.
_CANDIDATE = "candidate"
_SINGLE = "a single block; not searched inside"
_MIXED = "mixed classes"
_EMPTY = "empty"
_ONE = "one module"


def _classify(container: nn.Module) -> str:
    children = list(container)
    if not children:
        return _EMPTY
    if len({type(child) for child in children}) > 1:
        return _MIXED
    if len(children) >= 2:
        return _CANDIDATE
    # One block. A ModuleList of one is a stack of one layer (``num_hidden_layers=1``):
    # what it holds (an MoE layer's experts) are sub-blocks, so they are not searched.
    # A Sequential of one is more often a plain wrapper, so it is searched through.
    return _SINGLE if isinstance(container, nn.ModuleList) else _ONE


def _num_parameters(container: nn.Module) -> int:
    return sum(p.numel() for p in container.parameters())  # shared ones once


def _walk(module: nn.Module, prefix: str, seen: set[int]) -> Iterator[tuple[str, nn.Module, str]]:
    """Yield ``(path, container, verdict)`` for every container examined, outermost first.

    Candidates are not descended into: whatever they hold (an MoE layer's experts) is
    nested inside a candidate and can never be chosen; neither is a ``ModuleList`` of a
    single block. Each module is visited once, so shared modules and cycles are harmless.
    """
    if id(module) in seen:
        return
    seen.add(id(module))
    if isinstance(module, _CONTAINERS):
        verdict = _classify(module)
        yield prefix, module, verdict
        if verdict in (_CANDIDATE, _SINGLE):
            return
    for name, child in module.named_children():
        yield from _walk(child, _path(prefix, name), seen)


def _resolve(model: nn.Module, attr: str) -> list[nn.Module]:
    """The blocks at the dotted path ``attr`` (the ``attr=`` override)."""
    if not attr or any(not part for part in attr.split(".")):
        raise ValueError(
            f"attr={attr!r} is not a dotted attribute path; pass the path of the blocks "
            f"from the model, e.g. attr='model.layers' (Llama) or attr='transformer.h' (GPT-2)"
        )
    obj: object = model
    walked: list[str] = []
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            where = ".".join(walked) or "the model"
            children = (
                [name for name, _ in obj.named_children()] if isinstance(obj, nn.Module) else []
            )
            hint = f"; its children are {children}" if children else ""
            raise ValueError(
                f"attr={attr!r}: {where} ({type(obj).__name__}) has no attribute {part!r}{hint}"
            ) from None
        walked.append(part)
    if isinstance(obj, _CONTAINERS) or (
        isinstance(obj, (list, tuple)) and not isinstance(obj, nn.Module)
    ):
        blocks = list(obj)
    else:
        raise ValueError(
            f"attr={attr!r} names a {type(obj).__name__}; it must name an nn.ModuleList, "
            f"an nn.Sequential, or a list/tuple of nn.Module (the repeated blocks)"
        )
    if not blocks:
        raise ValueError(f"attr={attr!r} names an empty {type(obj).__name__}; no blocks to return")
    for i, block in enumerate(blocks):
        if not isinstance(block, nn.Module):
            raise ValueError(
                f"attr={attr!r}: item {i} is a {type(block).__name__}, not an nn.Module"
            )
    return blocks


def find_layers(model: nn.Module, attr: str | None = None) -> list[nn.Module]:
    """Find a model's repeated blocks (the decoder layers) for :class:`ActivationOffloader`.

    Without ``attr``, every ``nn.ModuleList`` and ``nn.Sequential`` in ``model`` (the
    model itself included) is examined. A *candidate* holds at least two modules, all of
    exactly one class. The result is the outermost candidate: one that is not nested
    inside another candidate, so the experts list inside an MoE layer, or the layers of
    a block made of sub-blocks, is never picked over the stack that holds them. For the
    same reason nothing inside an ``nn.ModuleList`` of a single module (a model built
    with one layer) is searched: that raises ``ValueError`` rather than return the
    experts of its one MoE layer. Works on Hugging Face decoder models
    (``model.layers`` of Llama, Mistral, Qwen2, Qwen2-MoE, Mixtral; ``transformer.h`` of
    GPT-2), ``nn.TransformerEncoder`` (``layers``) and user stacks such as
    ``nn.Sequential(*blocks)``.

    Tie-breaking: when several candidates are outermost (an encoder-decoder, a vision
    tower beside a language model), the one whose blocks hold the most parameters wins
    (shared parameters counted once); among equal counts, the first in module
    registration order. Pass ``attr`` to choose another one.

    Args:
        model: the model to search (an ``nn.Module``).
        attr: a dotted attribute path from ``model`` to the blocks, such as
            ``"model.layers"``; it overrides the search. It may name an
            ``nn.ModuleList``, an ``nn.Sequential`` or a list/tuple of modules; the blocks
            need not share a class. Default ``None``: search as described above.

    Returns:
        The blocks, in order, as a new ``list`` (the modules themselves, not copies).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``attr`` is neither a ``str``
            nor ``None``.
        ValueError: no candidate is found (the message lists every container examined,
            with its path, length and the classes it holds); or ``attr`` does not lead to
            a non-empty container of modules (the message names the missing part).

    Example:
        >>> from torch import nn
        >>> model = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, batch_first=True), 3)
        >>> layers = find_layers(model)  # model.layers
        >>> [type(layer).__name__ for layer in layers]
        ['TransformerEncoderLayer', 'TransformerEncoderLayer', 'TransformerEncoderLayer']
        >>> find_layers(model, attr="layers") == list(model.layers)
        True
        >>> offloader = offload.ActivationOffloader(layers)  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be a torch.nn.Module; got {type(model).__name__}"
            + (" (pass the model, not a tensor)" if isinstance(model, torch.Tensor) else "")
        )
    if attr is not None:
        if not isinstance(attr, str):
            raise TypeError(
                f"attr must be a str (a dotted path such as 'model.layers') or None; got "
                f"{type(attr).__name__} {attr!r}"
            )
        return _resolve(model, attr)

    examined = list(_walk(model, "", set()))
    candidates = [c for _, c, verdict in examined if verdict == _CANDIDATE]
    if not candidates:
        if examined:
            listing = "; ".join(
                f"{_display(p)} ({_describe(c)}; {verdict})" for p, c, verdict in examined
            )
            what = f"examined {len(examined)} container(s), none fits: {listing}"
        else:
            n = sum(1 for _ in model.modules())
            what = f"examined {n} module(s), none is an nn.ModuleList or nn.Sequential"
        raise ValueError(
            f"find_layers found no repeated blocks in {type(model).__name__}: it looks for "
            f"an nn.ModuleList or nn.Sequential of >= 2 modules of one class; {what}. "
            f"Pass attr='path.to.layers' to name the blocks."
        )
    # max() returns the first of equal keys: registration order breaks ties
    return list(max(candidates, key=_num_parameters))
