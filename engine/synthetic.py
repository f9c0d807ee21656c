"""Moved to `engine.llama.synthetic`; this name stays for code that still imports it from here."""

from .llama.synthetic import *  # noqa: F401,F403
from .llama.synthetic import __all__  # noqa: F401
