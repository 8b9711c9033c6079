"""Integrations with other libraries: FSDP2, TransformerEngine, Hugging Face."""
