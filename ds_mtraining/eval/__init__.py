"""Long-context evaluation of an exported HF causal LM: ``python -m ds_mtraining.eval MODEL_DIR``.

* :mod:`.passkey`: passkey retrieval over a depth x length grid (real filler text, exact match of
  the greedy answer; the prompts are :mod:`ds_mtraining.passkey`'s, as are the training samples);
* :mod:`.position_loss`: mean token loss by position bucket on held-out text;
* :mod:`.ruler`: RULER-style tasks (single passkey, multi-key needle, multi-value needle,
  variable tracking; :mod:`ds_mtraining.ruler`'s prompts) over a task x length x depth grid,
  scored by exact match of the greedy answer, with Wilson 95% intervals and as many trials as an
  interval of a given width needs;
* :mod:`.model_recall`: recall and density of MTraining's estimated index on the model's own
  attention, per layer and head (with the static baseline and the block oracle at that density);
* :mod:`.runtime`: loading, attention mode (dense SDPA or MTraining's sparse prefill), greedy
  decoding, held-out text; :mod:`.cli`: the command line (``--help``).
"""
from .model_recall import model_recall
from ..passkey import passkey_prompt, passkey_training_sample, random_key
from .passkey import exact_match, passkey_grid
from .position_loss import bucket_edges, loss_by_position, token_losses
from .ruler import run_trials, score, trials_for_width, wilson_interval

__all__ = ["model_recall", "exact_match", "passkey_grid", "passkey_prompt", "passkey_training_sample",
           "random_key", "bucket_edges", "loss_by_position", "token_losses", "run_trials", "score",
           "trials_for_width", "wilson_interval"]
