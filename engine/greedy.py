"""Moved to `engine.llama.greedy`; this name stays for code that still imports it from here."""

from .llama.greedy import BUILDS, fused_greedy  # noqa: F401

__all__ = ["BUILDS", "fused_greedy"]
