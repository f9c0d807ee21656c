"""Tandem's composition root: CLI, HTTP server, benchmarks, GUI launcher."""
