"""Tandem's Qt-free engine: llama.cpp backends, their schedulers and prefix caches, the router.

`engine.llama` is imported first on purpose: it loads the llama.cpp shared libraries before
anything of ours imports numpy (see that module's docstring).
"""

from . import llama  # noqa: F401  (import order matters)
