"""Backends: the protocol every kind implements, their configs, and one module per kind."""
