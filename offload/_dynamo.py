"""Entry points that run inside a module call stay eager under torch.compile."""
from __future__ import annotations
from typing import Any, Callable, TypeVar
import torch
F = TypeVar("F", bound=Callable[..., Any])
def eager(fn: F) -> F:
    """Mark ``fn`` as an opaque eager boundary: a compiled caller graph-breaks around it
    and dynamo never traces into it (our hooks touch storages, streams and Python state)."""
    return torch.compiler.disable(fn, recursive=True)  # type: ignore[return-value]
