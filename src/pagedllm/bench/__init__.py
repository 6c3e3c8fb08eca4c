"""Offline benchmarks: engine throughput, KV memory, kernels, the step profile, peers.

Each module is one ``pagedllm bench`` subcommand. The peers' workers (``peer_scripts/``) run
under the peers' own Pythons and are not part of this package's import graph.
"""
