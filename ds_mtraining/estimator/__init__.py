"""The vertical-slash estimator, every path of it (docs/DESIGN.md):

* :mod:`.rule`: Algorithm 1 in plain torch, the rule's statement and reference (CPU runs);
* :mod:`.fused`: the same rule fused on the GPU (csrc/cuda/estimator), no host sync;
* :mod:`.distributed`: from a ring's striped shards with small collectives (torch, or the fused passes);
* :mod:`.graphs`: the fused distributed estimate replayed from a CUDA graph per shape;
* :mod:`.documents`: the document-aware estimate's inputs on a ring;
* :mod:`.dispatch`: :func:`estimate_index`, the one place that picks among them.
"""
from .dispatch import estimate_index
from .rule import estimate_vertical_slash

__all__ = ["estimate_index", "estimate_vertical_slash"]
