"""The DeepSpeed op builder: a JIT build from an empty extension cache, and a prebuilt
install (DS_BUILD_MTRAINING=1 pip install, a background build: conftest) that imports without
compiling. Each runs in a subprocess and checks the op's forward and gradients against float64
dense attention."""
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import REPO, finish

from ds_mtraining_op_builder import MTrainingCPUBuilder, extension_root

# Defines check(module): one small GQA problem with a partial last block, vertical columns read
# alone and a slash block, against ds_mtraining.reference; raises on any mismatch.
CHECK = textwrap.dedent("""
    import torch
    from ds_mtraining import SparseIndex
    from ds_mtraining.reference import dense_attention_with_lse, dense_mask

    def check(module):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 200, h, 32, generator=g) for h in (4, 2, 2))
        vertical = torch.tensor([3, 70, 150]).expand(1, 4, 3)
        slash = torch.tensor([130]).expand(1, 4, 1)
        index = SparseIndex.from_vertical_slash(vertical, slash, 200, 64)
        from ds_mtraining.ops import op_index
        out, lse = module.forward(q, k, v, op_index(index), 0.2)
        dout = torch.randn(out.shape, generator=g)
        dq, dk, dv = module.backward(dout, q, k, v, out, lse, op_index(index), 0.2)
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = dense_attention_with_lse(*leaves, dense_mask(index), 0.2)
        ref_grads = torch.autograd.grad(ref_out, leaves, dout.double())
        for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv),
                                   (ref_out.detach(), ref_lse.detach(), *ref_grads)):
            error = (got.double() - want).abs().max().item()
            assert error <= 1e-5 * want.abs().max().item(), f"{name}: max error {error}"
""")


def run_python(code: str, env: dict, cwd: Path, timeout: int) -> str:
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout + result.stderr


INSTALL_TIMEOUT_S = 1200


def prebuilt_install(directory: Path):
    """``DS_BUILD_MTRAINING=1 pip install --target directory/site`` of the checkout (the CPU op
    only), the prebuilt test's background build (conftest)."""
    command = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-cache-dir",
               "--target", str(directory / "site"), str(REPO)]
    return command, dict(os.environ, DS_BUILD_MTRAINING="1", DS_BUILD_MTRAINING_CUDA="0")


def test_jit_build_in_fresh_extension_dir(tmp_path):
    """Runs first (conftest). When the session's extension cache holds no CPU op yet, the build goes
    there and is the session's own build (the ``cpu_op`` fixture then loads it): one compile, not
    two; otherwise it goes to an empty directory of its own. The op's folder starts with torch's
    lock file in it, as a process killed while building leaves it: the build must not wait for it."""
    builder = MTrainingCPUBuilder()
    if builder.prebuilt_available() or os.path.exists(builder.jit_library()):
        extensions = tmp_path / "torch_extensions"
    else:
        extensions = Path(extension_root())
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(extensions), PYTHONPATH=str(REPO))
    env.pop("DS_MTRAINING_NO_JIT", None)
    (extensions / "mtraining_cpu").mkdir(parents=True, exist_ok=True)
    (extensions / "mtraining_cpu" / "lock").touch()
    code = CHECK + textwrap.dedent(f"""
        from ds_mtraining_op_builder import MTrainingCPUBuilder
        builder = MTrainingCPUBuilder()
        module = builder.jit_load(verbose=False)
        assert module.__file__.startswith({str(extensions)!r}), module.__file__
        assert builder.load() is module, "load() must reuse the compiled module"
        check(module)
        print("JIT OK", module.__file__)
    """)
    out = run_python(code, env, tmp_path, timeout=900)
    assert "JIT OK" in out and "removing" in out, out
    # announced and timed under the prefix of the project's other lines
    assert re.search(r"^ds_mtraining: compiling the mtraining_cpu op once \(about .+; cached in .+\) \.\.\.$", out,
                     re.M) and re.search(r"^ds_mtraining: compiled the mtraining_cpu op in \d+ s$", out, re.M), out
    assert (extensions / "mtraining_cpu" / "mtraining_cpu.so").is_file()


@pytest.mark.slow
@pytest.mark.background_build(command=prebuilt_install)
def test_prebuilt_install_imports_without_compiling(background_build, tmp_path):
    process, log, directory = background_build
    finish(process, log, INSTALL_TIMEOUT_S)
    target = directory / "site"
    extensions = tmp_path / "torch_extensions"
    extensions.mkdir()
    assert list((target / "ds_mtraining").glob("mtraining_cpu_op*.so")), "the op was not prebuilt"

    # run outside the repository so that only the install can be imported; JIT is forbidden
    env = dict(os.environ, PYTHONPATH=str(target), TORCH_EXTENSIONS_DIR=str(extensions),
               DS_MTRAINING_NO_JIT="1")
    code = CHECK + textwrap.dedent(f"""
        import ds_mtraining, ds_mtraining_op_builder
        from ds_mtraining import ops
        assert ds_mtraining.__file__.startswith({str(target)!r}), ds_mtraining.__file__
        assert str(ds_mtraining_op_builder.csrc_root()).startswith({str(target)!r}), "csrc/ is not shipped"
        module = ops.op_module("cpu")
        assert module.__file__.startswith({str(target / "ds_mtraining")!r}), module.__file__
        check(module)
        print("PREBUILT OK", module.__file__)
    """)
    assert "PREBUILT OK" in run_python(code, env, tmp_path, timeout=300)
    report = run_python("from ds_mtraining.cli import main; main(['report'])", env, tmp_path, 120)
    assert "prebuilt" in report
    assert "liger-kernel" in report  # the optional package's row: found with its version, or what it brings
    assert not any(extensions.iterdir()), "nothing may be compiled when the op is prebuilt"


def test_report_names_the_cpu_accelerator_in_place_of_deepspeeds_warning(tmp_path):
    """Where no GPU is visible DeepSpeed warns, on import, that it set the accelerator to the CPU
    (the reference: a bare import); ``ds-mtraining report`` does not, and its row says why."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", COLUMNS="300")
    env.pop("DS_ACCELERATOR", None)
    warning = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
    assert warning in run_python("import deepspeed", env, tmp_path, 120)
    report = run_python("from ds_mtraining.cli import main; main(['report'])", env, tmp_path, 120)
    assert warning not in report and re.search(
        r"DeepSpeed accelerator +│ +│ cpu \(no CUDA device: named DS_ACCELERATOR=cpu here, in place of DeepSpeed's "
        r"'Setting accelerator to CPU' warning\)", report), report


def test_cpu_arch_is_deepspeeds_answer_without_its_probe():
    """The CPU builder's -march flag (part of the JIT cache key) equals DeepSpeed's CPUOpBuilder's
    on this machine, which reaches it through py-cpuinfo."""
    from deepspeed.ops.op_builder.cpu.builder import CPUOpBuilder
    builder = MTrainingCPUBuilder()
    assert builder.cpu_arch() == CPUOpBuilder.cpu_arch(builder)
