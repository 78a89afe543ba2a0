"""Benchmarks for namedmesh; each module runs as `python -m benchmarks.<name>`."""
