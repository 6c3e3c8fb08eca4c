"""Tensor parallelism over torch.distributed (gloo on CPU): the ranks' process group
(``collectives``), how a model and its weights split across ranks (``shard``), the plain per-step
message rank 0 sends (``step_message``), the worker processes (``worker``) and rank 0's side of it
(``runner``). See docs/tensor_parallel.md."""
