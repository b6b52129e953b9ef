"""bench.capacity's search, results file, resume, breakdown and overhead, driven by a fake launcher
(no training: a function that says which lengths fit)."""
import json

import pytest

from ds_mtraining.bench import capacity, e2e

FITS = {"mtraining": 786432, "ulysses": 131072}  # the longest length each mode trains
PLAN = {"offload_layers": 16, "gpu_total_gib": 139.8,
        "gpu": {"weights_gib": 5.7, "gradients_gib": 0.7, "optimizer_gib": 0.0, "checkpoints_gib": 63.0,
                "checkpoint_layer_gib": 3.0, "checkpoint_layers_on_gpu": 20},
        "host": {"available_gib": 125.0, "optimizer_gib": 51.7, "checkpoints_gib": 64.0},
        "transients": {"mlp_intermediates": 1.0, "attention_qkvo": 7.5, "loss_chunk_logits_fp32": 7.0},
        "predicted": {"gpu_peak_gib": 84.9, "host_peak_gib": 119.2}}


def fake_launcher(calls):
    """Trains up to FITS[mode]; one step ahead it runs out of GPU memory (MTraining) or the host
    check refuses (Ulysses). Step S / 2^18 s (x 1.05 with the memory tools), peak 40 + S / 2^14 GiB,
    resident 10 GiB."""
    def launch(config, gpus, world, folder, port, args):
        section = config["mtraining"]
        mode = {v: k for k, v in e2e.MODES.items()}[section["attention"]]
        seq_len = section["seq_len"]
        calls.append((mode, seq_len, section.get("memory")))
        if seq_len > FITS[mode]:
            raise e2e.LaunchFailed("oom" if mode == "mtraining" else "host", "does not fit")
        tools = section.get("memory") != capacity.TOOLS_OFF
        step = seq_len / 2 ** 18 * (1.05 if tools else 1.0)
        return {"step_s": step, "tokens_per_s": seq_len / step, "step_times_s": [step] * args.steps,
                "peak_memory_gib": [40.0 + seq_len / 2 ** 14] * world, "density": 0.05, "wall_s": 60.0,
                "resident_memory_gib": 10.0, "host_peak_rss_gib": 100.0, "offloaded_gib": 48.0, "plan": PLAN}
    return launch


def test_ladder_powers_of_two_and_half_steps():
    assert capacity.ladder(131072, 1 << 21) == [131072, 196608, 262144, 393216, 524288, 786432, 1048576, 1572864,
                                                2097152]
    assert capacity.ladder(1 << 16, 1 << 17) == [65536, 98304, 131072]


def test_search_up_and_down_resume_breakdown_and_overhead(tmp_path):
    """From 256K MTraining climbs until 1M runs out of memory (max 768K), Ulysses steps down until
    128K trains; the breakdown at 768K: peak 88 GiB - resident 10 - GPU checkpoints 63 = 15 GiB of
    transient, and the measured peaks over the plan's predicted ones. A second invocation from 1M
    reads every length from the file (no launch) and adds the overhead at 256K: 1.05."""
    calls = []
    argv = ["--cpu", "--models", "qwen2.5-3b", "--modes", "mtraining", "ulysses", "--starting_len", "262144",
            "--max_len", "2097152", "--density", "0.05", "--out", str(tmp_path), "--tag", "t"]
    record = capacity.Capacity(capacity.parse_args(argv), fake_launcher(calls)).run()
    assert [(m, s) for m, s, _ in calls] == [("mtraining", s) for s in (262144, 393216, 524288, 786432, 1048576)] + \
        [("ulysses", s) for s in (262144, 196608, 131072)]
    sparse, dense = record["models"]["qwen2.5-3b"]["mtraining"], record["models"]["qwen2.5-3b"]["ulysses"]
    assert sparse["max_seq_len"] == 786432 and sparse["limit"] == {"seq_len": 1048576, "failure": "oom"}
    assert dense["max_seq_len"] == 131072 and dense["limit"] == {"seq_len": 196608, "failure": "host"}
    parts = sparse["breakdown"]
    assert parts["peak_gib"] == pytest.approx(40 + 48) and parts["transient_measured_gib"] == pytest.approx(15.0)
    assert parts["largest_transient_analytic"] == {"name": "attention_qkvo", "gib": 7.5}
    assert (parts["checkpoints_host_gib"], parts["optimizer_host_gib"], parts["offloaded_layers"]) == (64.0, 51.7, 16)
    assert parts["gpu_peak_over_predicted"] == pytest.approx(88 / 84.9)  # measured over the plan's prediction
    assert parts["host_peak_over_predicted"] == pytest.approx(100 / 119.2)
    assert sparse["lengths"]["786432"]["tokens_per_s"] == pytest.approx(2 ** 18 / 1.05)
    saved = json.loads((tmp_path / "capacity_t.json").read_text())
    assert saved["models"] == json.loads(json.dumps(record["models"]))
    assert len(saved["commit"]) == 40 and isinstance(saved["dirty"], bool)
    assert {k: saved["invocations"][0][k] for k in ("commit", "dirty")} == {k: saved[k] for k in ("commit", "dirty")}
    assert (tmp_path / "capacity_t.png").stat().st_size > 10_000

    calls.clear()
    again = capacity.Capacity(capacity.parse_args(
        argv[:-8] + ["--modes", "mtraining", "--starting_len", "1048576", "--overhead_at", "262144", "--out",
                     str(tmp_path), "--tag", "t"]), fake_launcher(calls)).run()
    assert [(m, s) for m, s, _ in calls] == [("mtraining", 262144)] * 2  # the two overhead launches only
    assert calls[1][2] == capacity.TOOLS_OFF
    entry = again["models"]["qwen2.5-3b"]["mtraining"]
    assert entry["overhead"]["step_ratio"] == pytest.approx(1.05) and entry["max_seq_len"] == 786432
    assert again["models"]["qwen2.5-3b"]["ulysses"]["max_seq_len"] == 131072 and len(again["invocations"]) == 2


def test_optimizer_too_large_for_the_host_stops_the_search(tmp_path):
    """A host refusal with no checkpoint offloaded (the CPU optimizer alone) holds at every length:
    one launch, no step down; max_seq_len None, the limit "host"."""
    calls = []

    def refused(config, gpus, world, folder, port, args):
        calls.append(config["mtraining"]["seq_len"])
        raise e2e.LaunchFailed("host", "configuration error: host memory: the CPU optimizer needs 134.6 GiB (8.03B "
                                       "parameters x 18 bytes x 1/1 ranks on this node), 0 offloaded layer "
                                       "checkpoints 0.0 GiB, the processes 3.5 GiB, reserve 6.0 GiB")
    record = capacity.Capacity(capacity.parse_args(["--cpu", "--models", "llama-3.1-8b", "--starting_len", "524288",
                                                    "--out", str(tmp_path), "--tag", "t"]), refused).run()
    entry = record["models"]["llama-3.1-8b"]["mtraining"]
    assert calls == [524288] and entry["max_seq_len"] is None
    assert entry["limit"] == {"seq_len": 524288, "failure": "host"} and entry["breakdown"] is None


@pytest.mark.parametrize("line, kind", [("host memory: the CPU optimizer needs 134.6 GiB", "host"),
                                        ("GPU memory: at 4194304 tokens per rank the GPU estimate is 200.1", "oom")])
def test_a_plan_refusal_is_its_own_failure_kind(tmp_path, monkeypatch, line, kind):
    """bench.e2e's launch reports the run's exit as an error with the log's tail; the memory plan's
    refusal in it (the host check, or the GPU's estimate beyond every offload) makes the failure
    "host" or "oom", and the error is that line alone."""
    def refused(*_args):
        raise e2e.LaunchFailed("error", f"[launch.py] spawned ...\nds_mtraining.train: configuration error: {line}"
                                        "\n[launch.py] exit 2")
    monkeypatch.setattr(e2e, "launch", refused)
    with pytest.raises(e2e.LaunchFailed) as failure:
        capacity.capacity_launch({}, None, 1, tmp_path, 0, None)
    assert failure.value.kind == kind and str(failure.value) == line
