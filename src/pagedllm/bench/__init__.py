"""Benchmarks: workloads and the throughput comparison against HF transformers."""
