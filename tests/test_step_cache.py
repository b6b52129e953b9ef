"""Activation checkpointing with MTraining attention on CPU: the recomputed forward reuses the
index its forward estimated (one estimation per layer and step, counted), with ``keep_output``
its output too (one attention forward per layer and step, counted), and the gradients equal the
run without checkpointing (fp32)."""
import pytest
import torch
from helpers import SMALL, dense_loss, sequence, tiny_model

from ds_mtraining import SparseConfig, ops
from ds_mtraining.layer import attention as layer
from ds_mtraining.hf import use_mtraining_attention
from ds_mtraining.layer import AttentionStats, IndexCache, MTrainingAttentionSettings
from ds_mtraining.step import new_step
from ds_mtraining.training.memory import enable_checkpointing

CONFIG = SparseConfig(block_size=64, last_q=64, p_vertical=0.5, p_slash=0.5, max_vertical=16,
                      max_slash_diagonals=2)
LAYERS = SMALL["num_hidden_layers"]
STEPS = 2
GRAD_TOL = dict(rtol=1e-5, atol=1e-7)


def train_steps(monkeypatch, checkpointing: str | None, batches, micro_batches: int = 1, keep_output=False,
                attention_calls: list | None = None, dtype=torch.float32):
    """Gradients after the last step and the estimations counted per step (the attention kernel's
    forward calls per step into ``attention_calls`` when given)."""
    model = tiny_model("qwen2").to(dtype)
    model.train()
    settings = MTrainingAttentionSettings(CONFIG, stats=AttentionStats(), keep_output=keep_output)
    kernel_calls = []
    real_forward = ops.attention_forward
    monkeypatch.setattr(ops, "attention_forward", lambda *a, **kw: kernel_calls.append(1) or real_forward(*a, **kw))
    use_mtraining_attention(model, settings)
    if checkpointing is not None:
        enable_checkpointing(model, reentrant=checkpointing == "reentrant")
    counted = []
    real = layer.estimate_index
    monkeypatch.setattr(layer, "estimate_index", lambda *a, **kw: counted.append(1) or real(*a, **kw))
    per_step, recorded = [], []
    for step in range(STEPS):
        new_step()  # the training loop's step boundary
        settings.stats.reset()
        model.zero_grad()
        before, kernel_before = len(counted), len(kernel_calls)
        losses = [dense_loss(model, *batches[m]) for m in range(micro_batches)]
        sum(losses).backward()
        per_step.append(len(counted) - before)
        if attention_calls is not None:
            attention_calls.append(len(kernel_calls) - kernel_before)
        recorded.append(len(settings.stats.densities))
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, per_step, recorded


@pytest.fixture(scope="module")
def batch():
    return [sequence(batch=1)]


@pytest.mark.usefixtures("built_ops")
@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_one_estimation_per_layer_and_step(monkeypatch, batch, mode):
    plain, plain_counts, _ = train_steps(monkeypatch, None, batch)
    assert plain_counts == [LAYERS] * STEPS
    grads, counts, recorded = train_steps(monkeypatch, mode, batch)
    assert counts == [LAYERS] * STEPS, f"estimations per step with {mode} checkpointing: {counts}"
    assert recorded == [LAYERS] * STEPS, "the recomputed forward must not be recorded in the statistics"
    assert grads.keys() == plain.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain[name], **GRAD_TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.usefixtures("built_ops")
@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_keep_output_runs_attention_once_per_layer_and_step(monkeypatch, batch, mode):
    """keep_output: the recomputed forward takes its forward's output, so the kernel's forward
    runs once per layer and step (twice without), and the gradients equal the run without
    checkpointing (fp32: the kept output is the one the backward would have recomputed)."""
    plain, _, _ = train_steps(monkeypatch, None, batch)
    twice, kept = [], []
    train_steps(monkeypatch, mode, batch, attention_calls=twice)
    grads, counts, _ = train_steps(monkeypatch, mode, batch, keep_output=True, attention_calls=kept)
    assert twice == [2 * LAYERS] * STEPS and kept == [LAYERS] * STEPS, (twice, kept)
    assert counts == [LAYERS] * STEPS
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain[name], **GRAD_TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.usefixtures("built_ops")
@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_keep_output_in_bf16(monkeypatch, batch, mode):
    """bf16: the kept output is the rounded one (the recompute saves it upcast, with the forward's
    fp32 metadata, which non-reentrant checkpointing checks); the gradients stay within 2% in norm
    of the checkpointed run that recomputes attention (measured at most 0.7%, a k_proj bias)."""
    recomputed, _, _ = train_steps(monkeypatch, mode, batch, dtype=torch.bfloat16)
    kept_calls = []
    grads, _, _ = train_steps(monkeypatch, mode, batch, keep_output=True, attention_calls=kept_calls,
                              dtype=torch.bfloat16)
    assert kept_calls == [LAYERS] * STEPS
    for name, grad in grads.items():
        gap = float((grad.float() - recomputed[name].float()).norm() / recomputed[name].float().norm().clamp(min=1e-12))
        assert gap <= 2e-2, f"{name}: {gap:.3e}"


@pytest.mark.usefixtures("built_ops")
def test_without_the_cache_the_recompute_estimates_again(monkeypatch, batch):
    """The count above is what the cache saves: without it each layer estimates twice."""
    monkeypatch.setattr(IndexCache, "take", lambda self, key: None)
    _, counts, _ = train_steps(monkeypatch, "reentrant", batch)
    assert counts == [2 * LAYERS] * STEPS


@pytest.mark.usefixtures("built_ops")
def test_two_micro_batches_before_one_backward_stay_exact(monkeypatch):
    """Two forwards before one backward hold two entries per module: the recompute estimates
    again (same index) rather than guessing, and the gradients stay exact."""
    ids, labels = sequence(batch=2)
    batches = [(ids[:1], labels[:1]), (ids[1:], labels[1:])]
    plain, _, _ = train_steps(monkeypatch, None, batches, micro_batches=2)
    grads, counts, _ = train_steps(monkeypatch, "non-reentrant", batches, micro_batches=2)
    assert counts == [4 * LAYERS] * STEPS
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain[name], **GRAD_TOL, msg=lambda m: f"{name}: {m}")


def test_index_cache_takes_one_match_only():
    cache = IndexCache()
    cache.store("a", ("first", None))
    assert cache.take("b") is None and cache.take("a") == ("first", None) and cache.take("a") is None
    cache.store("a", (1, None))
    cache.store("a", (2, None))
    assert cache.take("a") is None and len(cache) == 2
    new_step()  # a new step drops the old entries at the next store
    cache.store("a", (3, None))
    assert len(cache) == 1 and cache.take("a") == (3, None)


def test_index_cache_holds_one_kept_output():
    """A kept output releases the older entries' (forwards with no backward between them, as in
    evaluation, hold one output per module, not one per forward); their indices stay."""
    new_step()
    cache = IndexCache()
    cache.store("a", (1, "out a"))
    cache.store("b", (2, "out b"))
    assert cache.take("a") == (1, None) and cache.take("b") == (2, "out b")
