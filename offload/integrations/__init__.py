"""Integrations with other libraries: FSDP2, TransformerEngine, Hugging Face."""

from offload.integrations import fsdp, te

__all__ = ["fsdp", "te"]
