"""Warnings that point at the user's line, not at a line inside this package or torch."""

from __future__ import annotations

import os
import sys
import warnings
from types import FrameType

import torch

__all__ = ["warn_at_caller"]

_SKIP = (
    # the package's folder (this module is in offload/_core/)
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
)


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first frame outside ``offload`` and ``torch``
    (the user's model or training loop), whatever the depth of the call."""
    frame: FrameType | None = sys._getframe(1)
    level = 2  # 1 is this function, 2 its caller
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_SKIP):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)
