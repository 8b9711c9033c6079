"""Integrations with other libraries: FSDP2, TransformerEngine, Hugging Face."""

from offload.integrations import fsdp, hf, te

__all__ = ["fsdp", "hf", "te"]
