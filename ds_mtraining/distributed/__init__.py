"""Process groups (sequence, data, sequence-data parallel; hierarchical ring) and local spawning."""
from .groups import (RING_KINDS, ParallelConfigError, ParallelGroups, check_parallel_sizes,
                     initialize_groups, local_world_size, resolve_ring_kind)
from .spawn import free_port, run_on_ranks, shutdown

__all__ = ["RING_KINDS", "ParallelConfigError", "ParallelGroups", "check_parallel_sizes",
           "initialize_groups", "local_world_size", "resolve_ring_kind", "free_port", "run_on_ranks",
           "shutdown"]
