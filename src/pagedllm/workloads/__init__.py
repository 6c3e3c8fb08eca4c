"""Workloads: request traces (JSONL), seeded synthetic workloads and text prompts.

Used by the simulator, the benchmarks and the HTTP load client. Plain data and the standard
library (and the tokenizer-free text generator): no engine, no torch.
"""
