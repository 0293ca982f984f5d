"""Benchmarks: commands that measure throughput and learning speed, run as ``python -m benchmarks.<name>``."""
