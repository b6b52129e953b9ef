"""MTraining attention for models: :mod:`.attention` (``striped_sparse_attention``, its settings,
statistics and per-module index cache) and :mod:`.ulysses` (the drop-in for DeepSpeed-Ulysses'
``DistributedAttention``)."""
from .attention import (AttentionStats, IndexCache, LayoutError, MTrainingAttentionSettings, check_striped,
                        striped_sparse_attention)
from .ulysses import DistributedAttention

__all__ = ["AttentionStats", "DistributedAttention", "IndexCache", "LayoutError", "MTrainingAttentionSettings",
           "check_striped", "striped_sparse_attention"]
