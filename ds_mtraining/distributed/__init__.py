"""Process groups (sequence, data, sequence-data parallel; the hierarchical ring's inner and outer
groups from the nodes x GPUs topology), the ring's rotater (:mod:`.comm`), local spawning and
shutdown."""
from .groups import (RING_KINDS, ParallelConfigError, ParallelGroups, check_parallel_sizes,
                     initialize_groups, resolve_ring_kind)
from .topology import local_world_size
from .spawn import free_port, on_shutdown, run_on_ranks, shutdown

__all__ = ["RING_KINDS", "ParallelConfigError", "ParallelGroups", "check_parallel_sizes",
           "initialize_groups", "local_world_size", "resolve_ring_kind", "free_port", "on_shutdown",
           "run_on_ranks", "shutdown"]
