"""ds-mtraining: distributed dynamic sparse attention for ultra-long-context training on DeepSpeed."""
from .attention import sparse_attention, sparse_attention_with_lse
from .config import SparseConfig
from .estimate import estimate_vertical_slash
from .index import SparseIndex, Stripe

__version__ = "0.1.0"



def __getattr__(name):
    """``ds_mtraining.integration`` on first use (it imports transformers and DeepSpeed)."""
    if name == "integration":
        import importlib
        return importlib.import_module(".integration", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["SparseConfig", "SparseIndex", "Stripe", "estimate_vertical_slash",
           "sparse_attention", "sparse_attention_with_lse", "__version__"]
