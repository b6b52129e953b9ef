"""The pieces of ``python -m ds_mtraining.train``: the ``mtraining`` config section
(:mod:`.run_config`), the model (:mod:`.model`), rank 0's progress and metrics (:mod:`.progress`)
and checkpoints (:mod:`.checkpoint`)."""

MTRAINING_KEY = "mtraining"  # the DeepSpeed JSON's section of MTraining settings


class ConfigError(ValueError):
    """An MTraining setting that cannot work; the message names the key and the fix."""
