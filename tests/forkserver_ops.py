"""Preloaded by the forkserver that forks the spawned ranks (conftest adds it once the session
builds the ops): every rank inherits the loaded CPU op and DeepSpeed's shm comm op instead of
loading them itself (~1.3 s of CPU per rank: a py-cpuinfo subprocess and a ninja check)."""
try:
    from deepspeed.comm.torch import build_shm_op
    from ds_mtraining import ops

    ops.op_module("cpu")
    build_shm_op()
except Exception as error:
    # the forkserver skips a preload that raises ImportError (any other error would kill it):
    # the ranks then load the ops themselves, and report what fails
    raise ImportError(f"ops not preloaded: {error}") from error
