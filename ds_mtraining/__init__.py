"""ds-mtraining: distributed dynamic sparse attention for ultra-long-context training on DeepSpeed."""
from .attention import sparse_attention, sparse_attention_with_lse
from .config import SparseConfig
from .estimator import estimate_vertical_slash
from .index import SparseIndex, Stripe

__version__ = "0.1.0"


__all__ = ["SparseConfig", "SparseIndex", "Stripe", "estimate_vertical_slash",
           "sparse_attention", "sparse_attention_with_lse", "__version__"]
