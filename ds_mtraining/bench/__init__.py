"""Benchmarks: kernel speed (GPU and CPU), ring balance, ring communication model."""
from __future__ import annotations

from typing import Callable

from ..index import SparseIndex


def index_for_density(build: Callable[[int], SparseIndex], most: int, target: float) -> SparseIndex:
    """The index ``build(n)``, n in [0, most], whose density is closest to ``target``, found by
    bisection (density grows with n, e.g. the number of slash diagonals)."""
    low, high, best = 0, most, None
    while low <= high:
        middle = (low + high) // 2
        index = build(middle)
        density = index.density()
        if best is None or abs(density - target) < abs(best.density() - target):
            best = index
        if density < target:
            low = middle + 1
        else:
            high = middle - 1
    return best
