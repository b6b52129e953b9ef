"""``ds_mtraining.train`` in readable parts: its one training step (:func:`train_step`) called
directly on a tiny model on the CPU, against the dense HF model (the loss) and plain SGD on the
dense model's gradient (the update); and no function of train.py longer than 60 lines."""
from __future__ import annotations

import ast
import copy

import pytest
import torch
from helpers import REPO, SMALL, dense_loss, sequence, tiny_model

from ds_mtraining import SparseConfig
from ds_mtraining.hf import use_mtraining_attention
from ds_mtraining.layer import AttentionStats, MTrainingAttentionSettings
from ds_mtraining.static import DensePattern
from ds_mtraining.training.model import MTrainingCausalLM

MAX_FUNCTION_LINES = 60
LR = 0.5


def test_no_function_of_train_py_is_longer_than_60_lines():
    path = REPO / "ds_mtraining" / "train.py"
    long = {node.name: node.end_lineno - node.lineno + 1 for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES}
    assert long == {}, f"functions of train.py over {MAX_FUNCTION_LINES} lines: split them"


class SGDEngine:
    """What :func:`train_step` uses of DeepSpeed's engine, over plain SGD (no accumulation scaling)."""

    device = torch.device("cpu")

    def __init__(self, module):
        self.module = module
        self.optimizer = torch.optim.SGD(module.parameters(), lr=LR)
        self.micro_steps = 0

    def __call__(self, **batch):
        return self.module(**batch)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.micro_steps += 1
        self.optimizer.step()
        self.optimizer.zero_grad()


class Batches:
    """``batch(position)``: one real-text sequence per position, unstriped (one rank)."""

    def __init__(self, count: int):
        ids, labels = sequence(batch=count, seq_len=128)
        self.rows = [(ids[i:i + 1], labels[i:i + 1]) for i in range(count)]
        self.read = []

    def batch(self, position: int) -> dict:
        self.read.append(position)
        ids, labels = self.rows[position]
        return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(ids.shape[1])[None]}


@pytest.mark.usefixtures("cpu_op")
def test_one_step_has_the_dense_models_loss_and_takes_its_sgd_step():
    """The step's loss is the dense HF model's on the same batch (MTraining attention over the full
    causal index is exact), and the step moves every weight by -lr x the dense model's gradient."""
    from ds_mtraining.train import train_step
    model = tiny_model("qwen2")
    reference = copy.deepcopy(model)
    stats = AttentionStats()
    use_mtraining_attention(model, MTrainingAttentionSettings(SparseConfig(block_size=64), stats=stats,
                                                              pattern=DensePattern()))
    engine = SGDEngine(MTrainingCausalLM(model, None, loss_chunk_tokens=64).train())
    batches = Batches(3)

    losses, position = train_step(engine, batches, 1, accumulation=1, stats=stats)

    ids, labels = batches.rows[1]
    expected = dense_loss(reference, ids, labels)
    expected.backward()
    assert (position, batches.read, engine.micro_steps) == (2, [1], 1)
    assert len(losses) == 1 and not losses[0].requires_grad
    torch.testing.assert_close(losses[0], expected.detach(), rtol=1e-5, atol=1e-5)
    stepped = dict(model.named_parameters())
    for name, before in reference.named_parameters():
        assert not torch.equal(stepped[name], before), f"{name} did not change"
        torch.testing.assert_close(stepped[name], before - LR * before.grad, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")
    # recorded (each layer's call) in the first micro-batch, then off
    assert len(stats.densities) == SMALL["num_hidden_layers"] and not stats.enabled


@pytest.mark.usefixtures("cpu_op")
def test_accumulation_reads_consecutive_micro_batches():
    """``accumulation`` micro-batches from ``position`` on, one engine step each, their losses in order."""
    from ds_mtraining.train import train_step
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    use_mtraining_attention(model, MTrainingAttentionSettings(SparseConfig(block_size=64), pattern=DensePattern()))
    engine = SGDEngine(MTrainingCausalLM(model, None, loss_chunk_tokens=64).train())
    engine.optimizer.param_groups[0]["lr"] = 0.0  # the weights stay: each loss is the dense model's
    batches = Batches(3)
    marks = []

    losses, position = train_step(engine, batches, 0, accumulation=3, at=marks.append)

    assert (position, batches.read, engine.micro_steps) == (3, [0, 1, 2], 3)
    assert marks == ["loading data", "forward", "backward", "optimizer step"] * 3
    with torch.no_grad():
        expected = [dense_loss(reference, *row) for row in batches.rows]
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=1e-5, atol=1e-5)
