"""Benchmark support: workloads that need no download."""
