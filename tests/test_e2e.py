"""bench.e2e: the per-layer extrapolation against a hand computation, the choice between full and
partial depth and the results file (with a fake launcher: no processes), and the whole script end to
end on 2 CPU ranks (--smoke), through the real training launcher."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, environment
from ds_mtraining.bench import e2e
from ds_mtraining.distributed.spawn import free_port


def test_extrapolation_hand_computed():
    # 2 layers 10 s, 4 layers 16 s: 3 s per layer, 4 s of embedding, head, loss and optimizer;
    # 36 layers = 4 + 36 x 3 = 112 s (and the same line read backwards or at a measured depth)
    assert e2e.extrapolate(10.0, 16.0, 2, 4, 36) == pytest.approx(112.0)
    assert e2e.extrapolate(16.0, 10.0, 4, 2, 36) == pytest.approx(112.0)
    assert e2e.extrapolate(10.0, 16.0, 2, 4, 4) == pytest.approx(16.0)
    with pytest.raises(ValueError, match="two different depths"):
        e2e.extrapolate(1.0, 2.0, 3, 3, 36)


def test_launch_config_changes_only_model_depth_length_mode_and_group():
    base = json.loads((REPO / e2e.DEFAULT_CONFIG).read_text())
    config = e2e.launch_config(base, "llama-3.1-8b", "ulysses", 262144, 2, 4)
    section = config.pop("mtraining")
    expected = dict(base.pop("mtraining"), seq_len=262144, sequence_parallel_size=2, attention="ulysses",
                    model={"name_or_path": "llama-3.1-8b", "config_overrides": {"num_hidden_layers": 4}},
                    data={"source": "random"})
    assert section == expected and config == base
    assert e2e.launch_config(base | {"mtraining": expected}, "llama-3.1-8b", "mtraining", 131072, 1, None)[
        "mtraining"]["model"] == {"name_or_path": "llama-3.1-8b", "config_overrides": {}}


SECOND_PER_LAYER, FIXED_S, OVERHEAD_S = 0.5, 2.0, 5.0


def fake_launcher(calls):
    """Step time FIXED_S + layers x SECOND_PER_LAYER x (S/1024)^2 (dense modes) or x S/1024
    (mtraining); peak memory 10 + layers GiB per rank. MTraining on one GPU at full depth and
    S = 4096 runs out of memory."""
    def launch(config, gpus, world, folder, port, args):
        section = config["mtraining"]
        mode = {v: k for k, v in e2e.MODES.items()}[section["attention"]]
        layers = section["model"]["config_overrides"].get("num_hidden_layers", 36)
        calls.append((mode, world, section["seq_len"], layers, gpus))
        if (mode, world, layers, section["seq_len"]) == ("mtraining", 1, 36, 4096):
            raise e2e.LaunchFailed("oom", "CUDA out of memory")
        growth = (section["seq_len"] / 1024) ** (2 if mode in e2e.QUADRATIC else 1)
        step = FIXED_S + layers * SECOND_PER_LAYER * growth
        return {"step_s": step, "tokens_per_s": section["seq_len"] / step, "step_times_s": [step] * args.steps,
                "peak_memory_gib": [10.0 + layers] * world, "losses": [12.0] * args.steps,
                "density": 0.1 if mode == "mtraining" else None, "wall_s": OVERHEAD_S + step * args.steps}
    return launch


def test_depth_choice_and_results_file(tmp_path):
    """auto: full depth, until the last full-depth step predicts a launch over --timeout (the dense
    modes at 4x the length: 5 + 3 x 20 x 16 s; MTraining's 5 + 3 x 20 x 4 s is launched) or the
    launch runs out of memory (MTraining, one GPU): then 2 and 4 layers, extrapolated to 36. A later
    invocation with one part keeps the other's numbers."""
    calls = []
    argv = ["--cpu", "--models", "qwen2.5-3b", "--seq_lens", "1024", "4096", "--timeout", "300",
            "--out", str(tmp_path), "--tag", "t"]
    record = e2e.Bench(e2e.parse_args(argv), fake_launcher(calls)).run()
    full = lambda growth: FIXED_S + 36 * SECOND_PER_LAYER * growth  # noqa: E731
    short, long = record["rows"]
    assert (short["seq_len"], long["seq_len"]) == (1024, 4096)
    assert short["speedup"] == pytest.approx(full(1) / full(1)) and short["extrapolated"] == []
    assert long["mtraining"]["step_s"] == pytest.approx(full(4)) and not long["mtraining"]["extrapolated"]
    assert long["ulysses"]["extrapolated"] and long["ulysses"]["full_depth"].startswith("skipped: a launch at full")
    assert long["ulysses"]["step_s"] == pytest.approx(full(16))  # the line through 2 and 4 layers, at 36
    assert long["ulysses"]["peak_memory_gib"] == pytest.approx([46.0, 46.0])
    assert [r["layers"] for r in long["ulysses"]["runs"]] == [2, 4]
    assert long["speedup"] == pytest.approx(full(16) / full(4))
    single = long["single_gpu"]
    assert single["mtraining"]["full_depth"].startswith("oom") and single["mtraining"]["step_s"] == pytest.approx(full(4))
    assert single["dense"]["full_depth"].startswith("skipped") and single["dense"]["step_s"] == pytest.approx(full(16))
    assert single["speedup"] == pytest.approx(full(16) / full(4))
    # one layer's time: the slope between 2 and 4 layers, without FIXED_S (dense/mtraining: 16/4)
    assert single["dense"]["per_layer_s"] == pytest.approx(SECOND_PER_LAYER * 16)
    assert single["dense"]["fixed_s"] == pytest.approx(FIXED_S)
    assert single["per_layer_speedup"] == pytest.approx(4.0) and long["per_layer_speedup"] is None
    assert long["extrapolated"] == ["single_gpu.dense", "single_gpu.mtraining", "ulysses"]
    assert ("ulysses", 2, 4096, 36, None) not in calls and ("mtraining", 1, 4096, 36, None) in calls  # CPU: no ids
    saved = json.loads((tmp_path / "e2e_t.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(record["rows"])) and {"utc", "device", "command"} <= set(saved)
    assert (tmp_path / "e2e_t.png").stat().st_size > 10_000  # the plot of step time against length

    again = e2e.Bench(e2e.parse_args(argv[:-4] + ["--seq_lens", "1024", "--parts", "single", "--single_depth", "4",
                                                  "--out", str(tmp_path), "--tag", "t"]), fake_launcher([])).run()
    short_again = again["rows"][0]
    assert short_again["ulysses"] == short["ulysses"] and short_again["single_gpu"]["dense"]["layers"] == 4
    assert not short_again["single_gpu"]["dense"]["extrapolated"] and len(again["invocations"]) == 2


def test_each_dense_kernel_is_a_baseline_of_its_own(tmp_path):
    """--dense_backends sdpa fa4: the baselines launch once per kernel (their JSON's
    mtraining.dense_backend), MTraining once; the SDPA ones keep the keys of earlier files (ulysses,
    dense, speedup), FA4's go under ulysses_fa4, dense_fa4 and speedup_fa4; the table has a column
    per kernel. Without FA4 installed the default is SDPA alone."""
    calls = []

    def by_kernel(config, gpus, world, folder, port, args, inner=fake_launcher(calls)):
        result = inner(config, gpus, world, folder, port, args)
        kernel = config["mtraining"].get("dense_backend")
        calls[-1] += (kernel,)
        if kernel == "fa4":  # FA4's baseline steps take half as long
            result = {**result, "step_s": result["step_s"] / 2, "tokens_per_s": result["tokens_per_s"] * 2}
        return result
    argv = ["--cpu", "--models", "qwen2.5-3b", "--seq_lens", "1024", "--depth", "2", "--single_depth", "2",
            "--dense_backends", "sdpa", "fa4", "--out", str(tmp_path), "--tag", "t"]
    record = e2e.Bench(e2e.parse_args(argv), by_kernel).run()
    assert [(c[0], c[1], c[-1]) for c in calls] == [
        ("mtraining", 2, None), ("ulysses", 2, "sdpa"), ("ulysses", 2, "fa4"),
        ("mtraining", 1, None), ("dense", 1, "sdpa"), ("dense", 1, "fa4")]
    row = record["rows"][0]
    step = FIXED_S + 2 * SECOND_PER_LAYER
    assert row["ulysses"]["dense_backend"] == "sdpa" and row["ulysses_fa4"]["dense_backend"] == "fa4"
    assert row["speedup"] == pytest.approx(1.0) and row["speedup_fa4"] == pytest.approx(0.5)
    single = row["single_gpu"]
    assert single["dense"]["step_s"] == pytest.approx(step) and single["dense_fa4"]["step_s"] == pytest.approx(step / 2)
    assert single["speedup"] == pytest.approx(1.0) and single["speedup_fa4"] == pytest.approx(0.5)
    assert row["extrapolated"] == []
    from rich.console import Console
    console = Console(width=300, record=True)
    console.print(e2e.table(record))
    text = console.export_text()
    assert "Ulysses W (FA4)" in text and "dense 1 GPU (FA4)" in text and "0.5x" in text
    assert e2e.parse_args(argv[:-7] + ["--out", str(tmp_path), "--tag", "u"]).dense_backends == ["sdpa"]  # CPU


@pytest.mark.usefixtures("built_ops")  # built before the launched ranks start
def test_smoke_end_to_end(tmp_path):
    """``--smoke`` (the W-rank pair here: one launch per mode, ~15 s each on 2 cores) through the real
    deepspeed launcher and ds_mtraining.train: the JSON has per seq_len the keys of both modes and
    the speedup, from logged step times; the profiled (warm-up) step's time by kind of work: the
    sparse op's calls under MTraining only, matrix products in both."""
    command = [sys.executable, "-m", "ds_mtraining.bench.e2e", "--smoke", "--parts", "sp", "--out", str(tmp_path),
               "--port", str(free_port()),  # the first launch takes this port, later ones free ones
               "--profile_step", "1"]
    done = subprocess.run(command, cwd=REPO, env=environment(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((tmp_path / "e2e_smoke.json").read_text())
    assert {"utc", "device", "command", "rows"} <= set(record) and "--smoke" in record["command"]
    row, = record["rows"]
    assert (row["model"], row["seq_len"], row["world"]) == ("tiny-qwen2", 512, 2)
    for mode in ("mtraining", "ulysses"):
        assert row[mode]["step_s"] is not None, f"{mode}: {row[mode].get('error')}\n{done.stdout[-3000:]}"
        assert row[mode]["step_s"] > 0 and row[mode]["layers"] == 2 and not row[mode]["extrapolated"]
        assert len(row[mode]["runs"][0]["losses"]) == 2 and row[mode]["peak_memory_gib"] is None  # CPU
        startup = row[mode]["runs"][0]["startup_s"]  # train.py's start-up phases, in order
        assert list(startup) == ["config, data, process groups and ops", "model", "DeepSpeed engine"], startup
        assert 0 < sum(startup.values()) < row[mode]["runs"][0]["wall_s"], startup
    assert 0 < row["mtraining"]["density"] <= 1 and row["ulysses"]["density"] is None  # only an index has one
    mtraining, ulysses = (row[mode]["runs"][0]["profile_ms_by_kind"] for mode in ("mtraining", "ulysses"))
    assert mtraining["attention"] > 0 and mtraining["gemm"] > 0 and ulysses["gemm"] > 0
    assert "attention" not in ulysses and ulysses["communication"] > 0  # SDPA, and Ulysses' all-to-alls
    assert ulysses["dense attention"] > 0 and "dense attention" not in mtraining
    free = row["mtraining"]["attention_free_s"]  # the step less the profiled sparse op's (and estimator's) time
    spent = sum(mtraining.get(kind, 0.0) for kind in ("attention", "estimator")) / 1e3
    assert free == pytest.approx(row["mtraining"]["step_s"] - spent)
    assert row["speedup_bound"] == pytest.approx(row["ulysses"]["step_s"] / free)
    assert row["speedup_bound"] >= row["speedup"]
    top = row["mtraining"]["runs"][0]["profile_top"]  # the costliest first, each with its kind
    assert 0 < len(top) <= 10 and [t["ms"] for t in top] == sorted((t["ms"] for t in top), reverse=True)
    assert any(t["kind"] == "attention" for t in top)
    assert row["speedup"] == pytest.approx(row["ulysses"]["step_s"] / row["mtraining"]["step_s"])
    assert "MTraining W" in done.stdout.split("e2e: tiny-qwen2 ulysses")[-1]  # the table, printed last


def test_speedup_bound_from_the_attention_free_step(tmp_path):
    """attention_free_step: the step less the profiled attention kinds (sparse, estimator, SDPA),
    by hand; a row's speedup_bound is the baseline's step over MTraining's attention-free step
    (extrapolated per layer at a partial depth), and is left out where MTraining's launch had no
    profile."""
    kinds = {"gemm": 900.0, "attention": 300.0, "estimator": 20.0, "dense attention": 5.0, "liger": 50.0}
    assert e2e.attention_free_step(2.0, kinds) == pytest.approx(2.0 - 0.325)
    assert e2e.attention_free_step(0.2, kinds) is None  # more attention than step: not this step's profile

    def profiled(config, gpus, world, folder, port, args, inner=fake_launcher([])):
        result = inner(config, gpus, world, folder, port, args)
        if config["mtraining"]["attention"] == "sparse":  # FIXED_S + 1 s per layer
            result["attention_free_s"] = FIXED_S + config["mtraining"]["model"]["config_overrides"]["num_hidden_layers"]
        return result
    argv = ["--cpu", "--models", "qwen2.5-3b", "--seq_lens", "1024", "--depth", "2", "--single_depth", "2",
            "--out", str(tmp_path), "--tag", "t"]
    row = e2e.Bench(e2e.parse_args(argv), profiled).run()["rows"][0]
    assert row["speedup_bound"] == pytest.approx(row["ulysses"]["step_s"] / (FIXED_S + 2))
    assert row["single_gpu"]["speedup_bound"] == pytest.approx(row["single_gpu"]["dense"]["step_s"] / (FIXED_S + 2))
    partial = ["--cpu", "--models", "qwen2.5-3b", "--seq_lens", "1024", "--depth", "partial", "--single_depth",
               "partial", "--out", str(tmp_path), "--tag", "partial"]
    row = e2e.Bench(e2e.parse_args(partial), profiled).run()["rows"][0]  # 2 and 4 layers, to 36
    assert row["mtraining"]["attention_free_s"] == pytest.approx(FIXED_S + 36)
    assert row["speedup_bound"] == pytest.approx(row["ulysses"]["step_s"] / (FIXED_S + 36))
    plain = e2e.Bench(e2e.parse_args(argv[:-1] + ["plain"]), fake_launcher([])).run()["rows"][0]
    assert plain["speedup_bound"] is None and plain["single_gpu"]["speedup_bound"] is None


def test_profile_kinds_by_name():
    from ds_mtraining.training.profile import OTHER, kind_of
    cases = {"void mtr::query_kernel<mtr::Sm90, __nv_bfloat16, 128, 128, 2, false>(mtr::AttentionParams)": "attention",
             "void mtr::specialized_query_kernel<__nv_bfloat16, 128, true>(mtr::AttentionParams)": "attention",
             "kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90_object_at_": "dense attention",
             "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128": "dense attention",
             "void mtr::est::(anonymous namespace)::masses_kernel(mtr::est::ScoreParams)": "estimator",
             "mtraining::backward": "attention", "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT": "gemm",
             "sm90_xmma_gemm_bf16bf16_bf16f32": "gemm", "aten::mm": "gemm",
             "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)": "communication",
             "c10d::allreduce_": "communication", "_rms_norm_forward_kernel": "liger",
             "Memcpy DtoD (Device -> Device)": "copies and fills", "aten::copy_": "copies and fills",
             "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, true>(Flash_fwd_params)":
                 "dense attention",
             "void flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128>>(Flash_bwd_params)":
                 "dense attention",
             "aten::_scaled_dot_product_flash_attention_for_cpu": "dense attention",
             "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>": OTHER}
    assert {name: kind_of(name) for name in cases} == cases


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_profile_counts_each_kernel_once():
    """train.py --profile_step on a GPU: the kinds sum kernel time only. ops.py's record_function
    ranges also appear on the GPU as annotations spanning their kernels; counted, they doubled
    attention's share (seen on an H200). Kernels on one stream cannot add up to more than the
    span they ran in, timed by CUDA events around the same calls."""
    import torch

    from ds_mtraining.attention import sparse_attention
    from ds_mtraining.index import SparseIndex
    from ds_mtraining.training.profile import profiled, summarise

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8192, h, 128, generator=generator).to("cuda", torch.bfloat16).requires_grad_()
               for h in (16, 2, 2))
    slash = torch.arange(1, 9).expand(1, 16, 8)
    index = SparseIndex.from_blocks(slash, torch.zeros(1, 16, 1, dtype=torch.long), 8192, 128, local_blocks=1)
    index = index.to("cuda")

    def step():
        sparse_attention(q, k, v, index, 0.1).float().square().sum().backward()

    step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profiled(True) as profiler:
        start.record()
        for _ in range(3):
            step()
        end.record()
    summary = summarise(profiler, 1, 0, 0.0)
    assert summary["ms_by_kind"]["attention"] > 0
    assert not [row for row in summary["top"] if row["name"].startswith("mtraining::")], summary["top"]
    assert summary["total_ms"] <= start.elapsed_time(end) * 1.02, (summary["total_ms"], start.elapsed_time(end))


def test_density_pins_mtraining_caps_only():
    """--density D: MTraining's slash cap marks about D x S / block block diagonals (a scattered token
    diagonal marks one or two) and max_vertical is --max_vertical; the baselines keep the config's."""
    base = json.loads((Path(REPO) / e2e.DEFAULT_CONFIG).read_text())
    sparse = e2e.launch_config(base, "qwen2.5-3b", "mtraining", 524288, 2, None, 0.05, 512)["mtraining"]["sparse"]
    assert sparse["max_slash_diagonals"] == round(0.05 * 524288 / 128) // 2 and sparse["max_vertical"] == 512
    assert sparse["p_slash"] == base["mtraining"]["sparse"]["p_slash"]  # the rest of the rule stays
    for mode in ("ulysses", "dense"):
        assert e2e.launch_config(base, "qwen2.5-3b", mode, 524288, 2, None, 0.05)["mtraining"]["sparse"] == \
            base["mtraining"]["sparse"]
    assert e2e.launch_config(base, "qwen2.5-3b", "mtraining", 524288, 2, None)["mtraining"]["sparse"] == \
        base["mtraining"]["sparse"]


def test_modes_launch_only_those_and_keep_the_others_numbers(tmp_path):
    """--modes mtraining (a long full-depth run): only MTraining launches, in both parts; the row's
    Ulysses and dense numbers from an earlier invocation stay, and the speedups use the new step."""
    argv = ["--cpu", "--models", "qwen2.5-3b", "--seq_lens", "1024", "--depth", "2", "--single_depth", "2",
            "--out", str(tmp_path), "--tag", "t"]
    first = e2e.Bench(e2e.parse_args(argv), fake_launcher([])).run()["rows"][0]
    calls = []
    row = e2e.Bench(e2e.parse_args(argv + ["--modes", "mtraining", "--steps", "5"]), fake_launcher(calls)).run()["rows"][0]
    assert [call[0] for call in calls] == ["mtraining", "mtraining"]
    assert row["ulysses"] == first["ulysses"] and row["single_gpu"]["dense"] == first["single_gpu"]["dense"]
    for result in (row["mtraining"], row["single_gpu"]["mtraining"]):
        assert [len(run["step_times_s"]) for run in result["runs"]] == [5]
    assert row["speedup"] == pytest.approx(row["ulysses"]["step_s"] / row["mtraining"]["step_s"])


def test_keep_attention_output_reaches_mtraining_launches_only():
    base = {"mtraining": {"keep_attention_output": True, "gradient_checkpointing": True}}
    for mode in e2e.MODES:
        for keep in (False, True):
            section = e2e.launch_config(base, "qwen2.5-3b", mode, 4096, 2, 2, keep_output=keep)["mtraining"]
            assert section.get("keep_attention_output", False) is (keep and mode == "mtraining"), (mode, keep)


def test_liger_setting_reaches_every_launch(tmp_path):
    """--liger sets mtraining.liger in every launch, MTraining and the baselines alike; without it
    the config's own setting stays."""
    for flag, expected in ((["--liger", "off"], False), (["--liger", "on"], True), ([], None)):
        seen = []

        def launch(config, gpus, world, folder, port, args, inner=fake_launcher([])):
            seen.append(config["mtraining"].get("liger"))
            return inner(config, gpus, world, folder, port, args)
        argv = ["--cpu", "--models", "qwen2.5-3b", "--seq_lens", "1024", "--depth", "2", "--single_depth", "2",
                "--out", str(tmp_path / str(flag)), "--tag", "t", *flag]
        e2e.Bench(e2e.parse_args(argv), launch).run()
        assert len(seen) == 4 and set(seen) == {expected}, (flag, seen)
