"""The trace-driven capacity simulator: how many GPUs a workload needs under each policy."""
