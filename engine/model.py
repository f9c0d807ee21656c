"""Moved to `engine.llama.model`; this name stays for code that still imports it from here."""

from .llama.model import (DEVICES, GGUF_MAGIC, Model, ModelInfo, ModelRegistry, check_gguf,  # noqa: F401
                          default_model_path, file_fingerprint, resolve_model)

__all__ = ["DEVICES", "GGUF_MAGIC", "Model", "ModelInfo", "ModelRegistry", "check_gguf", "default_model_path",
           "file_fingerprint", "resolve_model"]
