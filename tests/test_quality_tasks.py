"""RULER-style tasks (ds_mtraining.ruler, ds_mtraining.eval.ruler): each generator puts its answer
at the requested depth of a prompt of the requested length, each scorer scores a right answer right
and a wrong one wrong, Wilson intervals against hand computations; the training mix; and the 128K
quality study's driver (bench.quality long) end to end on CPU at toy lengths."""
import json
import re
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import text_tokens
from ds_mtraining.data import ByteTokenizer, DataConfigError, PackedSequences, check_data_spec
from ds_mtraining.eval.ruler import (run_trials, score, summarise, trials_for_width, wilson_interval,
                                     wilson_width)
from ds_mtraining.passkey import INTRO as PASSKEY_INTRO
from ds_mtraining.ruler import (MAGIC_INTRO, MULTIVALUE_VALUES, TASKS, VARTRACK_HOPS, VARTRACK_INTRO,
                                task_fixed_tokens, task_prompt, task_training_sample)

TOKENIZER = ByteTokenizer()
FILLER = text_tokens(3000).numpy()


def decode(ids) -> str:
    return TOKENIZER.decode(np.asarray(ids))


def oracle_answer(prompt_text: str, task: str) -> str:
    """The right answer read back from the prompt's text alone (what a perfect reader answers)."""
    if task == "passkey":
        return " " + re.search(r"The pass key is (\d+)\.", prompt_text).group(1)
    if task == "multikey":
        key = re.findall(r"What is the special magic number for (\w+)\?", prompt_text)[-1]
        return " " + re.search(rf"magic numbers for {key} is: (\d+)\.", prompt_text).group(1)
    if task == "multivalue":
        key = re.search(r"What are all the special magic numbers for (\w+)\?", prompt_text).group(1)
        return " " + ", ".join(re.findall(rf"magic numbers for {key} is: (\d+)\.", prompt_text))
    value = re.search(r"assigned the value (\d+)\.", prompt_text).group(1)
    chain, names = {}, []
    for name, source in re.findall(r"VAR ([A-Z]+) = (VAR [A-Z]+|\d+)", prompt_text):
        chain[name] = source
    for name, source in chain.items():
        while source.startswith("VAR "):
            source = chain[source[4:]]
        if source == value:
            names.append(name)
    return " " + " ".join(names)


# ----------------------------------------------------------------------------- generators
INTROS = {"passkey": PASSKEY_INTRO, "multikey": MAGIC_INTRO, "multivalue": MAGIC_INTRO, "vartrack": VARTRACK_INTRO}


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length, depth", [(700, 0.0), (900, 0.4), (1100, 1.0)])
def test_each_task_puts_its_answer_at_the_depth_and_length_asked(task, length, depth):
    prompt = task_prompt(task, TOKENIZER, FILLER, length, depth, np.random.default_rng(7))
    text = decode(prompt.input_ids)
    assert len(prompt.input_ids) == length and prompt.task == task
    assert len(prompt.pieces) == {"passkey": 1, "multikey": 4, "multivalue": MULTIVALUE_VALUES,
                                  "vartrack": VARTRACK_HOPS + 1}[task]
    # by hand (ASCII: one byte token per character): n filler tokens = length - intro - pieces -
    # question; the first piece starts after the intro, round(depth n) filler tokens and the
    # pieces placed before it (multikey's distractors)
    question = max(text.rfind("\n\nWhat"), text.rfind("\n\nFind all"))
    intro = INTROS[task]
    assert text.startswith(intro)
    n = question - len(intro) - sum(size for _, size in prompt.pieces)
    start, size = prompt.pieces[0]
    before = sum(s_size for s_start, s_size in prompt.pieces[1:] if s_start < start)
    assert start == len(intro) + round(depth * n) + before
    needle = text[start:start + size]
    assert needle.startswith("\n\n") and needle.endswith("\n\n") and prompt.answer[0] in needle
    # a reader of the text alone finds exactly the expected answer
    assert decode(prompt.answer_ids) == oracle_answer(text, task)
    # the filler is the real text window, in order, around the pieces
    filler = "".join(text[a + m:b] for (a, m), (b, _) in zip(
        [(0, len(intro))] + sorted(prompt.pieces), sorted(prompt.pieces) + [(question, 0)]))
    assert filler == decode(FILLER[:n])


def test_the_farthest_piece_is_at_the_depth_and_the_chain_stays_in_order():
    for seed in range(20):
        for task in ("multivalue", "vartrack"):
            prompt = task_prompt(task, TOKENIZER, FILLER, 1500, 0.3, np.random.default_rng(seed))
            starts = [s for s, _ in prompt.pieces]
            assert starts == sorted(starts)  # the first piece the farthest, the chain in its order
    prompt = task_prompt("vartrack", TOKENIZER, FILLER, 1500, 0.3, np.random.default_rng(1))
    text = decode(prompt.input_ids)
    names = re.findall(r"VAR ([A-Z]+) =", text)
    assert names == prompt.answer and len(set(names)) == VARTRACK_HOPS + 1


def test_prompts_are_seeded_and_too_short_lengths_are_refused():
    a = task_prompt("multikey", TOKENIZER, FILLER, 800, 0.5, np.random.default_rng(3))
    b = task_prompt("multikey", TOKENIZER, FILLER, 800, 0.5, np.random.default_rng(3))
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    with pytest.raises(ValueError, match="shorter than the multikey prompt's fixed text"):
        task_prompt("multikey", TOKENIZER, FILLER, 100, 0.5, np.random.default_rng(3))
    with pytest.raises(ValueError, match="unknown"):
        task_prompt("qa", TOKENIZER, FILLER, 800, 0.5, np.random.default_rng(3))


@pytest.mark.parametrize("task", TASKS)
def test_training_samples_keep_the_length_and_end_with_the_answer(task):
    window = FILLER[:1025].astype(np.int64)
    sample = task_training_sample(task, window, TOKENIZER, np.random.default_rng(5))
    assert len(sample) == len(window) and sample.dtype == window.dtype
    text = decode(sample)
    last_word = " are" if task in ("multivalue", "vartrack") else " is"
    question_end = text.rfind(last_word) + len(last_word)
    assert text[question_end:] == oracle_answer(text[:question_end], task)
    assert task_fixed_tokens(task, TOKENIZER) < len(window)


QUESTION_ENDS = {"passkey": r"What is the pass key\? The pass key is",
                 "multikey": r"The special magic number for \w+ is",
                 "multivalue": r"The special magic numbers for \w+ are",
                 "vartrack": r"The variables assigned the value \d+ are"}


@pytest.mark.parametrize("task", TASKS)
def test_training_samples_with_more_questions_answer_each_from_the_text_before_it(task):
    """Every question of a many-question sample comes after what it needs, followed by the answer
    that a reader of the text before it gives; multikey asks more than its first key."""
    window = FILLER[:2049].astype(np.int64)
    sample = task_training_sample(task, window, TOKENIZER, np.random.default_rng(7), questions=6)
    assert len(sample) == len(window)
    text = decode(sample)
    ends = [m.end() for m in re.finditer(QUESTION_ENDS[task], text)]
    assert len(ends) == 6 and text.endswith(oracle_answer(text[:ends[-1]], task))
    for end in ends:
        right = oracle_answer(text[:end], task)
        assert text[end:end + len(right)] == right
    if task == "multikey":
        assert len(set(re.findall(r"What is the special magic number for (\w+)\?", text))) > 1
    one = task_training_sample(task, window, TOKENIZER, np.random.default_rng(7))
    asked = text[text.rfind("\n\n"):]  # the last question and its answer (bytes: one token a character)
    assert task_fixed_tokens(task, TOKENIZER, questions=6) - task_fixed_tokens(task, TOKENIZER) == 5 * len(asked)
    assert len(re.findall(QUESTION_ENDS[task], decode(one))) == 1


# ----------------------------------------------------------------------------- scorers
@pytest.mark.parametrize("task, answer, right, wrong", [
    ("passkey", ["71432"], [" 71432.", "71432"], [" 714320", " 7143", "the key 71432"]),
    ("multikey", ["12345"], [" 12345.\n"], [" 12346", " 54321 12345"]),
    ("multivalue", ["11111", "22222", "33333", "44444"],
     [" 11111, 22222, 33333, 44444.", " 44444, 33333, 22222, 11111"],
     [" 11111, 22222, 33333", " 11111, 22222, 33333, 55555", " 11111, 11111, 22222, 33333, 44444"]),
    ("vartrack", ["ABCDE", "FGHIJ", "KLMNO"], [" ABCDE FGHIJ KLMNO", " KLMNO ABCDE FGHIJ."],
     [" ABCDE FGHIJ", " ABCDE FGHIJ KLMNP", " VAR ABCDE FGHIJ KLMNO"]),
])
def test_each_scorer_scores_a_right_answer_right_and_a_wrong_one_wrong(task, answer, right, wrong):
    assert all(score(task, text, answer) for text in right)
    assert not any(score(task, text, answer) for text in wrong)


def test_run_trials_scores_an_oracle_and_a_wrong_decoder_and_resumes():
    """A decoder that reads the answer from the prompt scores 1 in every cell, one with a fixed
    wrong answer 0; trials are the same prompts on every run; a run cut short by its deadline
    continues where it stopped, with the same rows as an uninterrupted run."""
    stream = text_tokens(6000).numpy()
    seen = []

    def oracle(ids, max_new_tokens):
        text = decode(ids)
        task = ("multivalue" if "What are all" in text else "vartrack" if "Find all variables" in text else
                "multikey" if "special magic number for" in text else "passkey")
        seen.append(len(ids))
        return TOKENIZER.encode(oracle_answer(text, task))[:max_new_tokens]

    grid = dict(tasks=TASKS, lengths=[600, 900], depths=[0.0, 0.5, 1.0], trials=2, target_width=None, seed=11)
    full = run_trials(oracle, TOKENIZER, stream, **grid)
    assert full["complete"] and len(full["rows"]) == 4 * 2 * 3 * 2 and all(r["correct"] for r in full["rows"])
    assert seen[:24] == [900] * 24  # the longest length first
    summary = summarise(full["rows"])
    assert summary["vartrack"]["600"]["accuracy"] == 1.0 and summary["vartrack"]["600"]["trials"] == 6
    assert summary["multikey"]["900"]["by_depth"]["0.5"]["trials"] == 2
    wrong = run_trials(lambda ids, n: TOKENIZER.encode(" 1 XYZ"), TOKENIZER, stream, **grid)
    assert not any(r["correct"] for r in wrong["rows"])
    # cut short, continued: the same rows
    partial = run_trials(oracle, TOKENIZER, stream, **grid, deadline=0.0)
    assert not partial["complete"] and partial["rows"] == []
    done = {(r["task"], r["length"], r["depth"], r["trial"]): r for r in full["rows"][:5]}
    resumed = run_trials(oracle, TOKENIZER, stream, **grid, done=done)
    key = lambda r: (r["task"], r["length"], r["depth"], r["trial"])  # noqa: E731
    assert sorted(map(key, resumed["rows"])) == sorted(map(key, full["rows"]))
    assert [r["answer"] for r in sorted(resumed["rows"], key=key)] == [r["answer"] for r in sorted(full["rows"], key=key)]


def test_run_trials_adds_rounds_until_the_interval_is_narrow_enough():
    stream = text_tokens(6000).numpy()
    always = lambda ids, n: TOKENIZER.encode(" 0")  # noqa: E731 - always wrong: accuracy 0
    ran = run_trials(always, TOKENIZER, stream, ["passkey"], [500], [0.0, 1.0], trials=4, target_width=0.3,
                     max_trials=64, seed=1)
    # Wilson at 0 of n: width z^2 / (n + z^2) < 0.3 from n = 9: three rounds of 8
    assert len(ran["rows"]) == 16 and wilson_width(0.0, 16) < 0.3 <= wilson_width(0.0, 8)
    capped = run_trials(always, TOKENIZER, stream, ["passkey"], [500], [0.0, 1.0], trials=4, target_width=0.01,
                        max_trials=16, seed=1)
    assert len(capped["rows"]) == 16


# ----------------------------------------------------------------------------- intervals
def test_wilson_interval_by_hand():
    # 8 of 10, z = 1.96: centre (0.8 + 1.9208/10) / 1.38415 = 0.71674, half-width
    # 1.96 sqrt(0.016 + 0.00960) / 1.38415 = 0.22657
    low, high = wilson_interval(8, 10)
    assert low == pytest.approx(0.49016, abs=2e-4) and high == pytest.approx(0.94331, abs=2e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    low, high = wilson_interval(0, 50)  # 0 of n: [0, z^2 / (n + z^2)]
    assert low == pytest.approx(0.0, abs=1e-12) and high == pytest.approx(3.8415 / 53.8415, rel=1e-4)
    assert wilson_interval(50, 50)[1] == 1.0
    for trials in range(1, 301):  # the share lies inside its interval, also where rounding leans out
        for successes in {0, 1, trials // 2, trials - 1, trials}:
            low, high = wilson_interval(successes, trials)
            assert 0.0 <= low <= successes / trials <= high <= 1.0, (successes, trials, low, high)


@pytest.mark.parametrize("accuracy, trials", [(0.5, 2398), (0.9, 868), (0.0, 93), (1.0, 93), (0.97, 303)])
def test_trials_for_a_four_point_interval(accuracy, trials):
    n = trials_for_width(accuracy, 0.04)
    assert n == trials and wilson_width(accuracy, n) < 0.04 <= wilson_width(accuracy, n - 1)
    # by hand: near the normal approximation's 4 z^2 p (1 - p) / w^2 in the middle (2401, 864), and
    # z^2 (1 - w) / w = 92.2 at 0 and 1
    wald = 4 * 1.959964 ** 2 * accuracy * (1 - accuracy) / 0.04 ** 2
    assert abs(n - wald) < 0.1 * wald if 0 < accuracy < 1 else n == 93


# ----------------------------------------------------------------------------- the training mix
def test_task_fractions_mix_the_tasks_into_training_and_keep_other_samples():
    from datasets import Dataset
    ids = [text_tokens(18000).numpy()]
    tokenized = Dataset.from_dict({"input_ids": ids, "length": [len(ids[0])]}).with_format("arrow")
    plain = PackedSequences(tokenized, 600, 0.25, TOKENIZER, seed=3)
    mixed = PackedSequences(tokenized, 600, 0.25, TOKENIZER, seed=3,
                            task_fractions={"vartrack": 0.25, "multikey": 0.25, "multivalue": 0.25})
    kinds = []
    for i in range(len(mixed)):
        text = decode(mixed[i][0].numpy())
        kinds.append("passkey" if "pass key" in text else "vartrack" if "VAR " in text else
                     "multivalue" if "What are all" in text else "multikey" if "magic number for" in text else None)
        if kinds[-1] == "passkey":  # a passkey sample is the one passkey_fraction alone would give
            assert decode(plain[i][0].numpy()) == text
        assert len(mixed[i][0]) == 600 and mixed.cu_seqlens(i).tolist() == [0, 600] or kinds[-1] is None
    assert None not in kinds and {"passkey", "vartrack", "multikey", "multivalue"} <= set(kinds)
    with pytest.raises(DataConfigError, match="sum to 1.25, more than 1"):
        check_data_spec({"source": "stdlib", "passkey_fraction": 0.5, "task_fractions": {"vartrack": 0.75}})
    with pytest.raises(DataConfigError, match="must map tasks of"):
        check_data_spec({"source": "stdlib", "task_fractions": {"passkey": 0.5}})
    assert check_data_spec({"source": "stdlib", "task_fractions": {"vartrack": 0.5}})["task_fractions"]
    with pytest.raises(DataConfigError, match="task_questions=0 must be a positive integer"):
        check_data_spec({"source": "stdlib", "task_fractions": {"vartrack": 0.5}, "task_questions": 0})
    asking = PackedSequences(tokenized, 1200, 0.0, TOKENIZER, seed=3, task_fractions={"multivalue": 1.0},
                             task_questions=3)
    assert all(decode(asking[i][0].numpy()).count("What are all") == 3 for i in range(len(asking)))
    with pytest.raises(DataConfigError, match="lower mtraining.data.task_questions"):
        PackedSequences(tokenized, 1200, 0.0, TOKENIZER, task_fractions={"multivalue": 1.0}, task_questions=9)




# ----------------------------------------------------------------------------- the study end to end
def _train_rank(rank, world, argv):
    from ds_mtraining.train import parse_args, train
    train(parse_args(argv))


def _toy_config(seq_len: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 1000000,
            "zero_optimization": {"stage": 0},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                              "warmup_num_steps": 1, "total_num_steps": 2}},
            "mtraining": {"seq_len": seq_len, "sequence_parallel_size": 1, "stripe_block": 64,
                          "sparse": {"last_q": 64, "max_vertical": 64, "max_slash_diagonals": 64},
                          "model": "tiny-qwen2", "tokenizer": "bytes", "document_masking": False,
                          "data": {"source": "stdlib", "passkey_fraction": 0.5,
                                   "task_fractions": {"multikey": 0.5}}, "loss_chunk_tokens": 256}}


@pytest.mark.usefixtures("built_ops")  # built before the rank starts
def test_the_long_study_end_to_end_on_cpu(tmp_path):
    """bench.quality long at toy size on CPU: pretrain (640 tokens), extend (its own config, passkey
    only, at 768 tokens, its own questions a sample, from pretrain's export), the probes of both models at their lengths, the
    slash budget, the three arms (1024 tokens) from extend's export on one token stream, static at
    sparse's final density, each evaluation at two lengths, compare; a call skips what an earlier
    call did, study.json refuses other settings, the arms refuse a start model whose probe solves
    too little of its trained task (and train with the check off), the result JSON holds the goals with margins, the
    rows, the plots and a RESULTS row; a later stay continues the arms from the start model's
    pack. Trained in-process on one spawned rank (the launcher's startup would take most
    of the time; the launch itself is bench.quality's launch_training)."""
    from datasets import Dataset
    from ds_mtraining.bench import quality
    from ds_mtraining.bench.launch import read_metric
    from ds_mtraining.data import stdlib_documents
    from ds_mtraining.distributed import run_on_ranks

    documents = stdlib_documents(document_chars=20000, max_documents=5)
    data = tmp_path / "data"
    data.mkdir()
    Dataset.from_list(documents[:3]).to_parquet(str(data / "train.parquet"))
    Dataset.from_list(documents[3:]).to_parquet(str(data / "heldout.parquet"))
    for name, length in (("base", 1024), ("pretrain", 640)):
        (tmp_path / f"{name}.json").write_text(json.dumps(_toy_config(length)))
    passkey_only = _toy_config(2048)  # the middle stage's own config: passkey samples only, at --extend_len
    passkey_only["mtraining"]["data"] = {"source": "stdlib", "passkey_fraction": 1.0}
    (tmp_path / "extend.json").write_text(json.dumps(passkey_only))
    trained, out = [], tmp_path / "study"

    def trainer(run):
        command = run.command(0)
        trained.append((run.save_dir.parent.name, run.resume))
        run_on_ranks(_train_rank, 1, command[command.index("ds_mtraining.train") + 1:], timeout=120)
        return True

    def call(*options, stages="all"):
        args = quality.parse_args(["long", "--out", str(out), "--data", str(data), "--device", "cpu",
                                   "--stages", stages, "--tag", "toy", *options])
        return quality.long_main(args, trainer=trainer, say=lambda line: None)

    first = ("--config", str(tmp_path / "base.json"), "--pretrain_config", str(tmp_path / "pretrain.json"),
             "--pretrain_steps", "2", "--extend_config", str(tmp_path / "extend.json"), "--extend_len", "768",
             "--extend_steps", "2", "--dense_stage_questions", "2", "--extend_questions", "3",
             "--probe_trials", "2", "--steps", "2", "--log_interval", "1", "--save_interval", "0",
             "--profile_step", "2", "--density_target", "0.9", "--eval_lengths", "512,1024", "--depths", "0,1",
             "--trials", "1", "--max_trials", "2", "--loss_windows", "1", "--buckets", "4")
    assert call(*first, stages="pretrain") is None and trained == [("pretrain", False)]
    with warnings.catch_warnings():  # compared part-way through (as a device call's end does): no arm yet
        warnings.simplefilter("error")
        partial = call(stages="compare")
    assert partial["arms"] == {"dense": None, "sparse": None, "static": None} and len(partial["plots"]) == 3
    assert "MTraining's density n/a at the end | held-out loss **n/a** of dense" in partial["results_row"]
    with pytest.raises(ValueError, match=r"other settings: --steps 3 \(the study's: 2\)"):
        call("--steps", "3")
    with pytest.raises(RuntimeError, match=r"\(the extend stage's, probed at 768 tokens\) solves passkey in 0 of "
                                           r"\d+, under --min_start_accuracy 0.5: it has not learned"):
        call()  # extend, the probes and the budget, then no arm: the start model retrieves nothing
    assert [name for name, _ in trained] == ["pretrain", "extend"]
    results = call("--min_start_accuracy", "0")  # the rest: the arms anyway, evaluations, compare
    assert [name for name, _ in trained] == ["pretrain", "extend", "dense", "sparse", "static"]
    # extend continues from the pretrained export, the arms from extend's, static at sparse's final density
    configs = {m: json.loads((out / m / "config.json").read_text())["mtraining"]
               for m in ("extend", "dense", "sparse", "static")}
    extend = configs.pop("extend")  # the dense stages ask twice and three times a sample, the arms as the study's config
    assert extend["model"] == str((out / "pretrain" / "hf").resolve()) and extend["seq_len"] == 768
    assert extend["data"]["passkey_fraction"] == 1.0 and "task_fractions" not in extend["data"]
    pretrain = json.loads((out / "pretrain" / "config.json").read_text())["mtraining"]
    assert [(c["data"]["passkey_questions"], c["data"]["task_questions"]) for c in (pretrain, extend)] == [(2, 2), (3, 3)]
    assert all("task_questions" not in c["data"] and "passkey_questions" not in c["data"] for c in configs.values())
    assert {c["model"] for c in configs.values()} == {str((out / "extend" / "hf").resolve())}
    assert results["extend"]["seq_len"] == 768 and results["extend"]["train_steps"][-1] == 2
    probes = results["probes"]  # each dense stage's model at its own length, before the arms
    assert {stage: (p["length"], list(p["loss"])) for stage, p in probes.items()} == {
        "pretrain": (640, ["640"]), "extend": (768, ["768"])}
    for probe in probes.values():
        assert {task: cell[str(probe["length"])]["trials"] for task, cell in probe["tasks"].items()} == dict.fromkeys(
            TASKS, 2)
    assert configs["static"]["static"]["density"] == pytest.approx(
        quality.tail_mean(read_metric(out / "sparse" / "run", "density")[1]))
    budget = json.loads((out / "study.json").read_text())["budget"]
    assert configs["sparse"]["sparse"]["max_slash_diagonals"] == budget["chosen"]["max_slash_diagonals"]
    evals = results["evals"]
    assert set(evals) == set(quality.LONG_EVALS) and all(evals.values())
    sparse = evals["sparse:sparse"]
    assert len(sparse["loss"]["1024"]["layer_density"]) == 2 and sparse["task_layer_density"]["1024"]["prompts"] > 0
    assert set(sparse["tasks"]) == set(TASKS) and sparse["tasks"]["vartrack"]["1024"]["trials"] == 2
    assert evals["dense:dense"]["loss"]["1024"]["layer_density"] is None
    goals = results["goals"]
    assert goals["length"] == 1024 and goals["sparse_density_le_0.1"]["pass"] is False
    assert goals["sparse_density_le_0.1"]["margin"] == pytest.approx(0.1 - results["arms"]["sparse"]["final_density"])
    assert "change" in goals["sparse_density_le_0.1"]
    assert goals["sparse_heldout_loss_gap_le_0.01"]["value"] == pytest.approx(
        evals["sparse:dense"]["loss"]["1024"]["heldout_loss"] / evals["dense:dense"]["loss"]["1024"]["heldout_loss"] - 1)
    assert goals["tokens_per_s_ratio_sparse_over_dense"] > 0
    same = results["comparisons"]["sparse:dense vs dense:dense"]
    assert same["1024"]["heldout_loss"] == pytest.approx(goals["sparse_heldout_loss_gap_le_0.01"]["value"])
    assert set(same["512"]) == {"heldout_loss", "last_bucket_loss", *TASKS}
    assert 0 < results["arms"]["sparse"]["profile"]["attention_share"] <= 1
    record = json.loads(Path(results["path"]).read_text())
    assert Path(results["path"]).name.startswith("quality_toy_cpu_")
    assert record["name"] == "quality_toy" and record["params"]["steps"] == 2 and record["goals"] == goals
    assert {(r["arm"], r["eval_attention"], r["length"]) for r in record["rows"]} == {
        (e.split(":")[0], e.split(":")[1], n) for e in quality.LONG_EVALS for n in (512, 1024)}
    assert all((out / name).is_file() for name in record["plots"]) and len(record["plots"]) == 3
    assert record["results_row"].startswith("| <a id=\"quality-1k\"></a>tiny-qwen2 continued at 1K for 2 steps from "
                                            "dense stages at 640 (2 steps) and 768 (2 steps), 2 and 3 questions a "
                                            "task sample, CPU (before them, the 640 model: passkey ")
    assert "; the 768 model: passkey " in record["results_row"] and "quality_toy_cpu_" in record["results_row"]
    # a later call skips every stage done
    count = len(trained)
    assert call(stages="pretrain,extend,probe,budget,dense,sparse,static,eval") is None and len(trained) == count
    assert all(len(ev["models"]) == 1 for ev in evals.values())

    # the next stay, on a bare machine: the archive (no models, checkpoints or pack) and the start
    # model's pack, carried part by part; the arm continues from the unpacked model, nothing retrains
    import shutil
    from ds_mtraining.bench.model_pack import MANIFEST
    pack = sorted((out / quality.START_PACK).glob("model.tar.part-*")) + [out / quality.START_PACK / MANIFEST]
    assert len(pack) == len(list((out / quality.START_PACK).iterdir())) >= 2
    original = (out / "extend" / "hf" / "model.safetensors").read_bytes()
    later = tmp_path / "later"
    shutil.copytree(out, later, ignore=shutil.ignore_patterns("hf", "step[0-9]*", "latest", quality.START_PACK))
    shutil.rmtree(later / "dense")
    out = later
    (later / quality.START_PACK).mkdir()
    for part in pack[1:]:  # the first part has not arrived
        shutil.copy(part, later / quality.START_PACK)
    with pytest.raises(FileNotFoundError, match=f"lacks {pack[0].name}"):
        call("--min_start_accuracy", "0", stages="dense")
    shutil.copy(pack[0], later / quality.START_PACK)
    assert call("--min_start_accuracy", "0", stages="dense") is None and trained[count:] == [("dense", False)]
    assert (later / "extend" / "hf" / "model.safetensors").read_bytes() == original  # fp32 arms: the exact bytes
    dense = json.loads((later / "dense" / "config.json").read_text())["mtraining"]
    assert dense["model"] == str((later / "extend" / "hf").resolve())


class _Scripted:
    """A TrainingLaunch whose command is a Python one-liner: the launch's signal handling without a launcher."""

    def __init__(self, tmp_path, code: str, deadline: float | None):
        from ds_mtraining.bench.quality import TrainingLaunch
        self.run = TrainingLaunch(tmp_path / "c.json", 2, tmp_path / "run", tmp_path / "hf", "cpu", 1, 1, 0, 0, False,
                               tmp_path / "train.log", deadline)
        self.run.command = lambda port: [sys.executable, "-c", code]


@pytest.mark.parametrize("code, deadline, expected", [
    ("print('trained')", None, True),
    ("import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: (print('saved'), sys.exit(143)))\n"
     "print('ready', flush=True)\ntime.sleep(60)", 1.5, False),
    ("import sys; print('boom'); sys.exit(3)", None, r"failed \(exit 3\)"),
])
def test_launch_training_stops_at_the_deadline_with_sigterm(tmp_path, code, deadline, expected):
    """launch_training: a run that ends is done; at the deadline the run's process group gets
    SIGTERM (the ranks save their step and exit 143): not done, resumed next call; any other
    exit is an error with the log's last lines."""
    import time
    from ds_mtraining.bench.quality import launch_training
    scripted = _Scripted(tmp_path, code, None if deadline is None else time.time() + deadline)
    if isinstance(expected, str):
        with pytest.raises(RuntimeError, match=expected + r"(.|\n)*boom"):
            launch_training(scripted.run)
        return
    began = time.time()
    assert launch_training(scripted.run) is expected
    assert time.time() - began < 10
    if expected is False:
        assert "saved" in (tmp_path / "train.log").read_text()


def test_dense_kernel_auto_is_sdpa_on_cpu_and_layer_densities_are_per_layer():
    from helpers import tiny_model
    from ds_mtraining.eval.runtime import DENSE_KERNEL_ATTRIBUTE, layer_densities, set_attention
    from ds_mtraining.hf import attention_modules
    model = tiny_model("qwen2", attn="sdpa")
    assert set_attention(model, "dense", None, "auto") is None
    assert model.config._attn_implementation == "sdpa"
    assert {getattr(m, DENSE_KERNEL_ATTRIBUTE) for m in attention_modules(model)} == {"sdpa"}
    # two forwards of three layers: each layer's mean over the forwards
    assert layer_densities([0.1, 0.2, 0.3, 0.3, 0.4, 0.5], 3) == pytest.approx([0.2, 0.3, 0.4])
    with pytest.raises(ValueError, match="not whole forwards of 3 layers"):
        layer_densities([0.1, 0.2], 3)


@pytest.mark.usefixtures("built_ops")
def test_static_evaluation_serves_sinks_and_the_local_window():
    """--attention static: at density 1 the window covers the prompt and the logits are dense
    attention's (SDPA, float32, the reference); at a one-block window a token between the sinks
    and the last block leaves the last position's logits exactly as they were (each layer sees its
    own block and the sinks, so no depth reaches it), where dense attention's move."""
    from helpers import tiny_model
    from ds_mtraining.config import SparseConfig
    from ds_mtraining.eval.runtime import set_attention
    sparse, ids = SparseConfig(block_size=64), text_tokens(256)[None]
    changed = ids.clone()
    changed[0, 100] = (changed[0, 100] + 1) % 256  # block 1 of 4, past the 4 sinks

    def logits(mode, tokens, density=None):
        model = tiny_model("qwen2", attn="sdpa")
        set_attention(model, mode, sparse, "sdpa", density)
        with torch.no_grad():
            return model(input_ids=tokens).logits[0].double()

    dense = logits("dense", ids)
    assert torch.allclose(logits("static", ids, 1.0), dense, atol=2e-5, rtol=1e-4)
    window = logits("static", ids, 0.05)
    assert torch.allclose(window[:64], dense[:64], atol=2e-5, rtol=1e-4)  # the first block: causal, all inside
    assert torch.equal(logits("static", changed, 0.05)[-1], window[-1])
    assert (logits("dense", changed)[-1] - dense[-1]).abs().max() > 1e-4
    with pytest.raises(ValueError, match="static_density"):
        set_attention(tiny_model("qwen2"), "static", sparse)


@pytest.mark.parametrize("argv, message", [
    (["long", "--out", "unused", "--dense_stage_questions", "0"], "--dense_stage_questions must be >= 1"),
    (["long", "--out", "unused", "--extend_questions", "0"], "--extend_questions must be >= 1"),
    (["run", "--steps", "0", "--config", "c", "--data", "d", "--out", "unused"], "--steps must be >= 1"),
])
def test_a_zero_count_is_refused_not_read_as_the_default(argv, message, capsys):
    from ds_mtraining.bench import quality
    with pytest.raises(SystemExit):
        quality.parse_args(argv)
    assert message in capsys.readouterr().err
