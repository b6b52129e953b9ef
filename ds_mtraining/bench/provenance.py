"""Moved to :mod:`ds_mtraining.record` (``provenance``); kept until its importers move there."""
from ..record import COMMIT_VARIABLE, DIRTY_SUFFIX, provenance  # noqa: F401
