"""Data plane of the KV cache: the pre-allocated tensors that blocks index into."""
