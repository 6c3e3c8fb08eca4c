"""The simulator and the planner: the real scheduler and KV manager replayed with a step-time model.

``pagedllm simulate`` (paged vs contiguous, the block-size sweep, placements, calibration) and
``pagedllm plan`` are products built here; the engine replay is the measured twin of the
simulator. Imports the control plane, ``workloads`` and (for calibration and kernel timing) the
engine; never ``bench`` or ``loadgen``.
"""
