"""Command-line tools outside the library core: :mod:`.ring_check`, the cluster check of the ring
(``deepspeed --hostfile H --module ds_mtraining.tools.ring_check --out DIR``)."""
