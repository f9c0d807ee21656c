"""Tandem's Qt-free engine: llama.cpp backends, their schedulers and prefix caches, the router.

Importing the package loads no native code: the pure modules (router, prefix cache, requests,
snapshots, scheduler rules, workloads, ...) import without llama.cpp. The native part starts at
`engine.llama`, which `engine.llama.model` (and so every backend) imports first; processes that load
models import it before anything imports numpy (see that module's docstring).
"""
