"""Chunked sequence-parallel cross-entropy against float64 ``torch.nn.functional.cross_entropy``
over full logits: values and gradients of the hidden states and the LM-head weight."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ds_mtraining.distributed import run_on_ranks
from ds_mtraining.loss import IGNORE_INDEX, sequence_parallel_cross_entropy, token_cross_entropy_sum
from ds_mtraining.layout import StripedLayout

TOL = dict(rtol=1e-5, atol=1e-6)  # fp32 chunked vs float64 full logits
VOCAB, DIM, BATCH, SEQ, BLOCK = 97, 16, 2, 256, 64


def problem(seed=0, ignored=True):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(BATCH, SEQ, DIM, generator=generator)
    weight = torch.randn(VOCAB, DIM, generator=generator) / DIM ** 0.5
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    if ignored:
        labels[0, :7] = IGNORE_INDEX
        labels[1, -1] = IGNORE_INDEX
    return hidden, weight, labels


def reference(hidden, weight, labels, reduction="mean"):
    """Float64 loss and its gradients with respect to hidden and weight."""
    h, w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    loss = F.cross_entropy((h @ w.T).reshape(-1, VOCAB), labels.reshape(-1), reduction=reduction,
                           ignore_index=IGNORE_INDEX)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [1, 100, 512, 10_000])
def test_chunked_sum_equals_full_logits(chunk):
    hidden, weight, labels = problem()
    expected, grad_h, grad_w = reference(hidden, weight, labels, reduction="sum")
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    total = token_cross_entropy_sum(h, w, labels, chunk_tokens=chunk)
    (total * 0.5).backward()  # a non-unit upstream gradient must scale both gradients
    torch.testing.assert_close(total.double(), expected, **TOL)
    torch.testing.assert_close(h.grad.double(), 0.5 * grad_h, **TOL)
    torch.testing.assert_close(w.grad.double(), 0.5 * grad_w, **TOL)


def test_single_process_mean_and_bf16():
    hidden, weight, labels = problem()
    expected, grad_h, _ = reference(hidden, weight, labels)
    h = hidden.clone().requires_grad_()
    loss = sequence_parallel_cross_entropy(h, weight, labels, group=None, chunk_tokens=64)
    loss.backward()
    torch.testing.assert_close(loss.double(), expected, **TOL)
    torch.testing.assert_close(h.grad.double(), grad_h, **TOL)
    # bf16 activations and weight: logits upcast to fp32, so the loss stays close
    loss16 = sequence_parallel_cross_entropy(hidden.bfloat16(), weight.bfloat16(), labels, chunk_tokens=64)
    assert abs(loss16.item() - expected.item()) < 2e-2


def test_bad_labels_and_shapes_are_refused():
    hidden, weight, labels = problem()
    with pytest.raises(ValueError, match="vocab=97"):
        token_cross_entropy_sum(hidden, weight, torch.full_like(labels, VOCAB))
    with pytest.raises(ValueError, match="leading dimensions"):
        token_cross_entropy_sum(hidden, weight, labels[:, :-1])
    with pytest.raises(ValueError, match="chunk_tokens"):
        token_cross_entropy_sum(hidden, weight, labels, chunk_tokens=0)
    with pytest.raises(ValueError, match="runs on CUDA tensors, got cpu; pass fused=False"):
        token_cross_entropy_sum(hidden, weight, labels, fused=True)


def _striped_loss_worker(rank, world):
    hidden, weight, labels = problem()
    layout = StripedLayout(world, BLOCK)
    h = layout.shard(hidden, rank).clone().requires_grad_()
    w = weight.clone().requires_grad_()
    loss = sequence_parallel_cross_entropy(h, w, layout.shard(labels, rank), dist.group.WORLD, chunk_tokens=50)
    loss.backward()
    grad_w = w.grad.clone()
    dist.all_reduce(grad_w)  # what DeepSpeed does over a sequence-parallel group
    return {"loss": loss.item(), "grad_hidden": h.grad, "grad_weight": grad_w}


@pytest.mark.parametrize("world", [2, 4])
def test_striped_ranks_value_is_global_mean_and_grads_sum_to_full(world):
    """Every rank reports the global mean; the rank gradients (weight summed over ranks, hidden
    states unstriped) equal the full-sequence gradients. Labels are ignored unevenly across
    ranks, so a per-rank mean would be wrong."""
    results = run_on_ranks(_striped_loss_worker, world, timeout=120)
    hidden, weight, labels = problem()
    expected, grad_h, grad_w = reference(hidden, weight, labels)
    for result in results:
        assert result["loss"] == pytest.approx(expected.item(), rel=1e-5)
        torch.testing.assert_close(result["grad_weight"].double(), grad_w, **TOL)
    full_grad_h = StripedLayout(world, BLOCK).unshard([r["grad_hidden"] for r in results])
    torch.testing.assert_close(full_grad_h.double(), grad_h, **TOL)


def test_loss_benchmark_runs_on_cpu(tmp_path):
    """bench.loss on CPU at a tiny shape: every chunk size it times agrees with float64 (its own
    agreement check, fp32) and the JSON names the fastest."""
    from ds_mtraining.bench import loss as bench_loss
    result = bench_loss.main(["--device", "cpu", "--tokens", "300", "--vocab", "211", "--hidden", "32",
                              "--check-tokens", "300", "--chunk-tokens", "64", "1000", "--repeats", "1",
                              "--dtype", "float32", "--out", str(tmp_path / "loss.json")])
    (case,) = result["rows"]
    assert set(case["results"]) == {"chunked_64", "chunked_1000"} and case["fastest"] in case["results"]
    for row in case["results"].values():
        assert max(row["errors_vs_float64"].values()) < 1e-5
    assert (tmp_path / "loss.json").exists()
