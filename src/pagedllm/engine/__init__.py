"""Request lifecycle: parameters, scheduling, model execution, sampling and outputs."""
