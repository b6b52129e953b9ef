"""Balanced (block-striped) sparse ring attention over a sequence-parallel process group."""
from .merge import merge_lse, merge_partial
from .ring_attention import ring_sparse_attention, ring_sparse_attention_with_lse
from .work import imbalance, pair_work, step_work

__all__ = ["imbalance", "merge_lse", "merge_partial", "pair_work", "ring_sparse_attention",
           "ring_sparse_attention_with_lse", "step_work"]
