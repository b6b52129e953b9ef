"""The training step clock: the one place that says "a new training step began".

What runs once per training step rather than once per attention call reads this clock: the
ranks' agreement check (:mod:`ds_mtraining.ring.agreement`), the layer's position-id check on
CUDA and its per-module index cache (:mod:`ds_mtraining.layer.attention`). They only read it
(:func:`current_step`); none of them knows what a training step is.

Whoever runs steps says when one begins, in one way, :func:`new_step`: the training loop
(``ds_mtraining.train``) at each optimizer step, the wrapped forward of
:mod:`ds_mtraining.integration` at each forward, evaluation and benchmark loops at each pass. A
process that never calls it is in one step from its first call on (the first call counts as a
step's first).
"""
from __future__ import annotations

_step = {"count": 0}


def new_step():
    """Starts a training step: the next attention call checks again what is checked once per step
    (the ranks' agreement on each process group; on CUDA the striped position ids), and the index
    caches drop the entries of earlier steps."""
    _step["count"] += 1


def current_step() -> int:
    """How many times :func:`new_step` was called in this process."""
    return _step["count"]
