"""Integrations with other libraries: FSDP2, TransformerEngine, Hugging Face."""

from offload.integrations import fsdp

__all__ = ["fsdp"]
