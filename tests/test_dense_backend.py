"""The dense baselines' kernel setting (``mtraining.dense_backend``, ds_mtraining/dense_backend.py) on
CPU: parsing (a bad value is one line naming the valid ones), ``auto``'s fallback to SDPA and the
line it prints, the refusal of ``fa4`` where it cannot run (one line naming why: no CUDA device,
not Hopper/Blackwell, the package missing or broken), and that the dense kernel with the resolved
backend equals float64 dense causal attention with gradients. The GPU side (FA4 itself) is
tests/test_cuda_fa4.py. A GPU is imitated by replacing torch.cuda's probes, and FA4's import by
replacing ``_import_fa4``."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ds_mtraining import dense_backend
from ds_mtraining.dense_backend import (FA4_PACKAGE, DenseBackendError, check_dense_backend, dense_causal_attention,
                                        resolve_dense_backend)
from ds_mtraining.reference import dense_attention, outputs_and_grads
from ds_mtraining.training import ConfigError

VALID = r"use one of \['auto', 'sdpa', 'fa4'\]"


def one_line(error) -> str:
    text = str(error.value)
    assert "\n" not in text, text
    return text


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA device of the compute capability the test sets (``gpu(9, 0)``) and FA4's import as
    the test sets it (``imports``: None imports fine, else the exception it raises; each call of
    the import is counted)."""
    state = {"imports": None, "calls": 0}

    def fake_import():
        state["calls"] += 1
        if state["imports"] is not None:
            raise state["imports"]
        return object()

    def make(major: int, minor: int = 0, imports: Exception | None = None):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
        monkeypatch.setattr(dense_backend, "_import_fa4", fake_import)
        state["imports"] = imports
        return state
    return make


# ----------------------------------------------------------------------------- parsing
@pytest.mark.parametrize("value", ["fa3", "SDPA", None, True])
def test_a_bad_setting_is_one_line_naming_the_valid_ones(value):
    with pytest.raises(DenseBackendError) as error:
        check_dense_backend(value)
    assert one_line(error).startswith(f"dense_backend={value!r} is not a dense backend")


def test_the_run_config_takes_the_setting_and_refuses_a_bad_one():
    from test_training import demo_config
    from ds_mtraining.training.run_config import load_run_config
    assert load_run_config(demo_config(), 2)[0].dense_backend == "auto"
    for value in ("sdpa", "fa4", "auto"):  # fa4 is checked where it would run, on the rank's device
        assert load_run_config(demo_config(attention="dense", dense_backend=value), 2)[0].dense_backend == value
    with pytest.raises(ConfigError, match=rf"^mtraining.dense_backend='flash' is not a dense backend; {VALID}"):
        load_run_config(demo_config(dense_backend="flash"), 2)


def test_the_integration_settings_take_the_setting_and_refuse_a_bad_one():
    from ds_mtraining.integration import resolve_settings
    assert resolve_settings(None, 1).dense_backend == "auto"
    assert resolve_settings({"mtraining": {"attention": "dense", "dense_backend": "fa4"}}, 1).dense_backend == "fa4"
    with pytest.raises(DenseBackendError, match=rf"dense_backend='fa2' is not a dense backend; {VALID}"):
        resolve_settings(None, 1, dense_backend="fa2")


# ----------------------------------------------------------------------------- auto's fallback
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case: no CUDA device")
def test_auto_is_sdpa_without_cuda_and_says_why():
    backend = resolve_dense_backend("auto", key="mtraining.dense_backend")
    assert backend.name == "sdpa"
    assert backend.describe() == ("dense attention kernel: sdpa (mtraining.dense_backend='auto': SDPA, FA4 cannot "
                                  "run here (no CUDA device))")


def test_auto_takes_sdpa_where_the_rule_does_not_pick_fa4_without_importing_it(gpu, monkeypatch):
    state = gpu(9, 0)
    monkeypatch.setattr(dense_backend, "AUTO_FA4_MAJORS", frozenset())
    backend = resolve_dense_backend("auto")
    assert (backend.name, backend.why) == ("sdpa", "dense_backend='auto': SDPA on compute capability 9.0")
    assert state["calls"] == 0  # the CuTe DSL's libraries are not loaded for nothing


def test_auto_takes_fa4_where_the_rule_picks_it_and_it_runs(gpu, monkeypatch):
    gpu(9, 0)
    monkeypatch.setattr(dense_backend, "AUTO_FA4_MAJORS", frozenset({9}))
    assert resolve_dense_backend("auto").name == "fa4"


def test_auto_falls_back_to_sdpa_where_fa4_is_missing_with_the_pip_command(gpu, monkeypatch):
    gpu(9, 0, ModuleNotFoundError("No module named 'flash_attn'"))
    monkeypatch.setattr(dense_backend, "AUTO_FA4_MAJORS", frozenset({9}))
    backend = resolve_dense_backend("auto", key="mtraining.dense_backend")
    assert backend.name == "sdpa"
    assert backend.why.startswith("mtraining.dense_backend='auto': SDPA, FA4 cannot run here (flash_attn.cute is "
                                  "not installed (No module named 'flash_attn'); pip install " + FA4_PACKAGE)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case: no CUDA device")
def test_a_run_prints_the_kernel_first_and_refuses_fa4_as_a_config_error():
    from ds_mtraining.train import dense_backend_of
    from ds_mtraining.training.run_config import load_run_config
    from test_training import demo_config, ulysses_config
    assert dense_backend_of(load_run_config(demo_config(), 2)[0]) is None  # sparse: no dense kernel
    assert dense_backend_of(load_run_config(ulysses_config(), 2)[0]).name == "sdpa"
    run, _ = load_run_config(demo_config(attention="dense", dense_backend="fa4"), 2)
    with pytest.raises(ConfigError) as error:
        dense_backend_of(run)
    assert one_line(error) == ("mtraining.dense_backend='fa4' cannot run here: no CUDA device; set it to 'sdpa' "
                               "or 'auto'")


# ----------------------------------------------------------------------------- fa4's refusal
@pytest.mark.parametrize("major, minor, imports, why", [
    (8, 0, None, r"compute capability 8.0 is neither Hopper \(9.x\) nor Blackwell \(10.x-12.x\), where FA4 trains"),
    (9, 0, ModuleNotFoundError("No module named 'flash_attn'"),
     r"flash_attn.cute is not installed \(No module named 'flash_attn'\); pip install flash-attn-4==4.0.0b36 "),
    (10, 0, RuntimeError("No CTK flavor installed: expected _cutlass_ir.cu{N}\nmore"),
     r"flash_attn.cute does not import \(No CTK flavor installed: expected _cutlass_ir.cu\{N\}\); reinstall: pip "),
])
def test_fa4_where_it_cannot_run_is_one_line_naming_why(gpu, major, minor, imports, why):
    gpu(major, minor, imports)
    with pytest.raises(DenseBackendError, match=rf"^dense_backend='fa4' cannot run here: {why}") as error:
        resolve_dense_backend("fa4")
    assert one_line(error).endswith("; set it to 'sdpa' or 'auto'")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case: no CUDA device")
def test_fa4_without_cuda_is_refused():
    with pytest.raises(DenseBackendError) as error:
        resolve_dense_backend("fa4")
    assert one_line(error) == "dense_backend='fa4' cannot run here: no CUDA device; set it to 'sdpa' or 'auto'"


def test_fa4_on_hopper_and_blackwell_with_the_package_is_fa4(gpu):
    for major in (9, 10, 12):
        gpu(major)
        assert resolve_dense_backend("fa4").name == "fa4"


# ----------------------------------------------------------------------------- the kernel
@pytest.mark.parametrize("batch, seq, heads, kv_heads, dim", [(1, 37, 4, 4, 16), (2, 64, 8, 2, 32)])
def test_the_resolved_dense_kernel_equals_float64_causal_attention_with_gradients(batch, seq, heads, kv_heads, dim):
    """The kernel ``auto`` resolves to on CPU (SDPA), fp32, against float64: relative Frobenius error
    below 1e-5 for the output and dq/dk/dv, GQA too."""
    generator = torch.Generator().manual_seed(seq)
    q, dout = (torch.randn(batch, seq, heads, dim, generator=generator) for _ in range(2))
    k, v = (torch.randn(batch, seq, kv_heads, dim, generator=generator) for _ in range(2))
    scale = 0.7 / dim ** 0.5
    causal = torch.ones(seq, seq, dtype=torch.bool).tril().expand(batch, heads, seq, seq)
    ours = outputs_and_grads(lambda *t: dense_causal_attention(*t, scale, "sdpa"), q, k, v, dout)
    reference = outputs_and_grads(lambda *t: dense_attention(*t, causal, scale), q, k, v, dout)
    for what, mine, exact in zip(("out", "dq", "dk", "dv"), ours, reference):
        error = float((mine.double() - exact).norm() / exact.norm())
        assert error < 1e-5, (what, error)


def test_an_unresolved_kernel_name_is_refused():
    q = torch.zeros(1, 4, 1, 8)
    with pytest.raises(DenseBackendError, match="dense attention kernel 'auto' is not 'sdpa' or 'fa4'"):
        dense_causal_attention(q, q, q, 1.0, "auto")


# ----------------------------------------------------------------------------- the Ulysses baseline's attention
def test_ulysses_takes_the_fa4_attention_and_it_refuses_what_it_cannot_compute():
    """At W = 1 DeepSpeed registers nothing: the model runs its core attention as set, FA4's under
    ``ds_mtraining_fa4``; the function refuses masks, dropout and sliding windows before any kernel."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from helpers import tiny_model
    from ds_mtraining.hf import FA4_ATTENTION_NAME, fa4_attention_forward, use_ulysses_attention
    model = tiny_model("qwen2")
    use_ulysses_attention(model, [0], 1, 128, dense_backend="fa4")
    assert model.config._attn_implementation == FA4_ATTENTION_NAME
    assert ALL_ATTENTION_FUNCTIONS[FA4_ATTENTION_NAME] is fa4_attention_forward
    use_ulysses_attention(model, [0], 1, 128, dense_backend="sdpa")
    assert model.config._attn_implementation == "sdpa"
    module = model.model.layers[0].self_attn
    q = torch.zeros(1, 4, 8, 16)
    for kwargs, message in ((dict(attention_mask=torch.zeros(1, 1, 8, 8)), "takes no attention mask"),
                            (dict(attention_mask=None, dropout=0.1), "attention dropout 0.1 is not supported"),
                            (dict(attention_mask=None, sliding_window=4), r"sliding-window attention \(window 4\)")):
        with pytest.raises(ValueError, match=message):
            fa4_attention_forward(module, q, q, q, **kwargs)


def _ulysses_fa4_worker(rank, world):
    """The tiny Qwen2's logits with the dense backend fa4 under DeepSpeed-Ulysses on ``world`` gloo
    ranks (FA4's kernel replaced by SDPA, counting its calls), against the model's own SDPA over the
    whole sequence: (calls, the module serving the fa4 name, the largest logit difference)."""
    import deepspeed
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import ds_mtraining.hf as hf
    from helpers import sequence, tiny_model
    calls = []

    def sdpa_in_fa4s_place(q, k, v, scale, backend):
        calls.append((backend, q.shape[1], q.shape[2]))
        return dense_causal_attention(q, k, v, scale, "sdpa")

    hf.dense_causal_attention = sdpa_in_fa4s_place
    deepspeed.init_distributed()
    model = tiny_model("qwen2", attn="sdpa")
    ids, _ = sequence(1, 256)
    local = 256 // world
    with torch.no_grad():
        reference = model(input_ids=ids).logits[:, rank * local:(rank + 1) * local]
        hf.use_ulysses_attention(model, list(range(world)), 1, 256, dense_backend="fa4")
        positions = torch.arange(rank * local, (rank + 1) * local)[None]
        logits = model(input_ids=ids[:, rank * local:(rank + 1) * local], position_ids=positions).logits
    served = ALL_ATTENTION_FUNCTIONS[hf.FA4_ATTENTION_NAME].__module__
    hf.remove_ulysses_attention()
    return calls, served, float((logits - reference).abs().max())


@pytest.mark.usefixtures("built_ops")  # DeepSpeed's shm op built before the ranks start
def test_ulysses_on_two_ranks_runs_the_fa4_attention_over_the_whole_sequence():
    """At W = 2 DeepSpeed's UlyssesSPAttentionHF wraps the fa4 attention: after its all-to-all each
    rank's call holds the whole sequence (256 tokens) and half the heads (2 of 4), and the logits
    equal the single-process model's (fp32: 1e-5)."""
    from ds_mtraining.distributed import run_on_ranks
    for calls, served, difference in run_on_ranks(_ulysses_fa4_worker, 2, timeout=240):
        assert served == "deepspeed.runtime.sequence_parallel.ulysses_sp"
        assert calls == [("fa4", 256, 2)] * 2  # two layers
        assert difference < 1e-5


# ----------------------------------------------------------------------------- bench.kernel
def test_bench_kernel_times_each_kernel_once_and_refuses_fa4_where_it_cannot_run(gpu, monkeypatch):
    from ds_mtraining.bench.kernel import build_parser, dense_backends
    args = build_parser().parse_args(["--dense-backend", "sdpa", "fa4", "--skip-sparse"])
    assert (args.dense_backend, args.skip_sparse) == (["sdpa", "fa4"], True)
    gpu(9, 0)
    monkeypatch.setattr(dense_backend, "AUTO_FA4_MAJORS", frozenset())
    assert json.dumps(dense_backends(["auto", "sdpa", "fa4"])) == json.dumps({
        "sdpa": "--dense-backend='auto': SDPA on compute capability 9.0", "fa4": "--dense-backend='fa4'"})
    gpu(8, 0)
    with pytest.raises(SystemExit, match=r"^bench.kernel: --dense-backend='fa4' cannot run here: compute capability "
                                         r"8.0 is neither Hopper"):
        dense_backends(["sdpa", "fa4"])


def test_bench_kernel_head_dim_study_holds_one_run_per_head_dim(tmp_path, monkeypatch):
    """--head-dims: bench.kernel's run at each head_dim (its own file meanwhile), then one study
    file with the runs in order, the newest run's commit, and no part file left."""
    from ds_mtraining.bench import kernel
    from ds_mtraining.record import write_json
    seen = []

    def fake_run(args):
        seen.append((args.head_dim, Path(args.out).name, args.head_dims))
        record = {"device": "GPU", "commit": f"{args.head_dim:040d}", "dirty": False, "shape": {"head_dim": args.head_dim}}
        write_json(args.out, record)
        return record
    monkeypatch.setattr(kernel, "run", fake_run)
    args = kernel.build_parser().parse_args(["--head-dims", "64", "256", "--out", str(tmp_path / "study.json")])
    study = kernel.head_dim_study(args)
    assert seen == [(64, "study_d64.json", None), (256, "study_d256.json", None)]
    assert json.loads((tmp_path / "study.json").read_text()) == study
    assert [r["shape"]["head_dim"] for r in study["runs"]] == [64, 256] and study["commit"] == f"{256:040d}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study.json"]
