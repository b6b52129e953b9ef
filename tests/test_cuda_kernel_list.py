"""The CUDA kernels' instantiations are what csrc/cuda/generate_kernels.py writes (no hand edits,
none stale), and ds_mtraining.ops names the same head dims and dtypes (no GPU needed)."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import torch

from ds_mtraining import ops

GENERATOR = Path(__file__).resolve().parents[1] / "csrc" / "cuda" / "generate_kernels.py"


def test_instantiations_are_the_generators():
    done = subprocess.run([sys.executable, str(GENERATOR), "--check"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_ops_names_the_generated_head_dims_and_dtypes():
    spec = importlib.util.spec_from_file_location("generate_kernels", GENERATOR)
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert ops.CUDA_HEAD_DIMS == generator.HEAD_DIMS
    names = {"bf16": torch.bfloat16, "fp16": torch.float16}
    assert set(ops.CUDA_DTYPES) == {names[tag] for tag in generator.DTYPES}
