"""The model-family matrix (ds_mtraining.families) on CPU: every supported family, built from
transformers' own config class, trains under MTraining with a full index over 2 striped ranks
with the loss and summed gradients of the same model (same weights) on one process with its own
eager attention over the whole sequence; sliding-window layers run their window exactly at a
length longer than the window. A model MTraining cannot train (attention dropout) is refused in one
line, before any process group. Also the ring with a window against float64 dense attention.

Tolerances: fp32 on both sides, only the summation order differs (as tests/test_hf.py)."""
import pytest
import torch
import torch.distributed as dist
from helpers import dense_loss, every_entry_config, ring_inputs, sequence, summed_grads

from ds_mtraining import SparseConfig
from ds_mtraining.distributed import initialize_groups, run_on_ranks
from ds_mtraining.documents import doc_start_from_cu_seqlens, document_causal_mask
from ds_mtraining.families import FAMILIES, TOY_WINDOW, family, family_config, markdown_table, matrix_rows
from ds_mtraining.hf import check_model_config, use_mtraining_attention
from ds_mtraining.layer import MTrainingAttentionSettings
from ds_mtraining.layout import StripedLayout
from ds_mtraining.reference import dense_attention, outputs_and_grads
from ds_mtraining.ring import ring_sparse_attention
from ds_mtraining.training.model import MTrainingCausalLM
from ds_mtraining.window import window_index

WORLD, BLOCK, SEQ = 2, 64, 512  # SEQ > TOY_WINDOW: windows cut in
TIMEOUT_S = 240
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = dict(rtol=1e-4, atol=3e-5)
REF_TOL = dict(atol=2e-5, rtol=1e-4)     # fp32 ring vs float64
SUPPORTED = [f.name for f in FAMILIES]
WINDOWED = {"Qwen2 (sliding window)", "Mistral", "Gemma-2 (soft-capping off)", "Gemma-3 (text)", "gpt-oss"}
FULL = every_entry_config(SEQ, BLOCK)
SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0])  # one logit per query head of ring_inputs' 4


def toy_model(name: str, attention: str):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    config = family_config(family(name))
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention).float()


def window_inputs():
    q, k, v, dout, _ = ring_inputs(SEQ, BLOCK, seed=5)
    return q, k, v, dout, doc_start_from_cu_seqlens(torch.tensor([0, 150, 151, 400, SEQ]), SEQ)


def _worker(rank, world):
    groups = initialize_groups(world, "flat")
    layout = StripedLayout(world, BLOCK)
    input_ids, labels = sequence()
    positions = layout.positions(SEQ, rank)[None]
    results = {}
    for name in SUPPORTED:
        model = toy_model(name, "eager")
        settings = MTrainingAttentionSettings.from_groups(FULL, groups)
        wrapper = MTrainingCausalLM(use_mtraining_attention(model, settings), groups.sequence_group, 100)
        loss = wrapper(layout.shard(input_ids, rank), layout.shard(labels, rank), positions)
        loss.backward()
        results[name] = {"loss": loss.item(), "grads": summed_grads(model, groups.sequence_group)}
    q, k, v, dout, doc_start = window_inputs()
    index = window_index(1, q.shape[2], SEQ, BLOCK, TOY_WINDOW)
    shards = [layout.shard(t, rank) for t in (q, k, v, dout)]
    results["ring_window"] = {
        documents: outputs_and_grads(lambda a, b, c: ring_sparse_attention(
            a, b, c, SparseConfig(block_size=BLOCK), groups.sequence_group, index=index,
            doc_start=doc_start if documents else None, window=TOY_WINDOW), *shards)
        for documents in (False, True)}
    sinks = SINKS.clone().requires_grad_()
    out = ring_sparse_attention(*shards[:3], SparseConfig(block_size=BLOCK), groups.sequence_group,
                                index=index, window=TOY_WINDOW, sinks=sinks)
    out.backward(shards[3])
    grad = sinks.grad.clone()
    dist.all_reduce(grad, group=groups.sequence_group)  # each rank's rows' share, summed
    results["ring_sinks"] = (out.detach(), grad)
    return results


@pytest.fixture(scope="module")
def results(built_ops):  # the ops are built before the ranks start
    return run_on_ranks(_worker, WORLD, timeout=TIMEOUT_S)


@pytest.mark.parametrize("name", SUPPORTED)
def test_family_trains_with_its_own_eager_attentions_loss_and_gradients(results, name):
    input_ids, labels = sequence()
    model = toy_model(name, "eager")
    loss = dense_loss(model, input_ids, labels)
    loss.backward()
    if name in WINDOWED:  # the window cuts in at this length: the comparison sees it
        unwindowed = toy_model(name, "eager")
        unwindowed.config.sliding_window = SEQ
        for module in unwindowed.modules():
            if getattr(module, "sliding_window", None):
                module.sliding_window = SEQ
        assert abs(dense_loss(unwindowed, input_ids, labels).item() - loss.item()) > 1e-4
    for rank_result in results:
        result = rank_result[name]
        torch.testing.assert_close(torch.tensor(result["loss"]), loss.detach(), **LOSS_TOL)
        for param_name, param in model.named_parameters():
            torch.testing.assert_close(result["grads"][param_name], param.grad, **GRAD_TOL, msg=param_name)


@pytest.mark.parametrize("documents", [False, True], ids=["one-document", "documents"])
def test_ring_with_a_window_equals_float64_dense(results, documents):
    q, k, v, dout, doc_start = window_inputs()
    i = torch.arange(SEQ)
    mask = (i[None] <= i[:, None]) & (i[None] > i[:, None] - TOY_WINDOW)
    if documents:
        mask = mask & document_causal_mask(doc_start)[0]
    want = outputs_and_grads(lambda a, b, c: dense_attention(a, b, c, mask), *(t.double() for t in (q, k, v, dout)))
    layout = StripedLayout(WORLD, BLOCK)
    for rank, rank_result in enumerate(results):
        for label, got, reference in zip("out dq dk dv".split(), rank_result["ring_window"][documents], want):
            torch.testing.assert_close(got, layout.shard(reference, rank).float(), **REF_TOL,
                                       msg=lambda m: f"{label} rank {rank}: {m}")


def test_ring_with_a_window_and_sinks_equals_float64_dense(results):
    """Sinks join each row's softmax once, after the ring's last merge; their gradient is the
    ranks' shares summed (as DeepSpeed sums a sequence-parallel group's)."""
    from test_sinks import sink_attention
    q, k, v, dout, _ = window_inputs()
    i = torch.arange(SEQ)
    mask = (i[None] <= i[:, None]) & (i[None] > i[:, None] - TOY_WINDOW)
    sinks = SINKS.double().requires_grad_()
    want = sink_attention(*(t.double() for t in (q, k, v)), mask, sinks)
    want.backward(dout.double())
    layout = StripedLayout(WORLD, BLOCK)
    for rank, rank_result in enumerate(results):
        out, grad = rank_result["ring_sinks"]
        torch.testing.assert_close(out, layout.shard(want.detach(), rank).float(), **REF_TOL)
        torch.testing.assert_close(grad, sinks.grad.float(), **REF_TOL)


def test_a_refused_model_gets_one_line_before_any_process_group():
    from transformers import AutoModelForCausalLM
    from ds_mtraining.integration import enable
    model = AutoModelForCausalLM.from_config(family_config(family("Llama"), attention_dropout=0.1))
    with pytest.raises(ValueError) as error:
        enable(model)
    message = str(error.value)
    assert message.startswith("LlamaConfig: attention_dropout=0.1 is not supported") and "\n" not in message
    assert not dist.is_initialized()


def test_a_head_dim_above_the_cuda_kernels_is_refused_for_cuda_only():
    config = family_config(family("Gemma"), hidden_size=512 * 4, head_dim=512)
    check_model_config(config, "mtraining.model", "cpu")  # the CPU op takes any head_dim
    with pytest.raises(ValueError, match=r"^mtraining.model: head_dim=512: MTraining's CUDA kernels take head_dim up "
                                         r"to 256; train this model on CPU$"):
        check_model_config(config, "mtraining.model", "cuda")
    check_model_config(family_config(family("Gemma"), hidden_size=256 * 4, head_dim=256), "mtraining.model", "cuda")
    check_model_config(family_config(family("Phi-3"), hidden_size=96 * 4), "mtraining.model", "cuda")  # padded


@pytest.mark.parametrize("head_dim,device_type,runs_at", [(96, "cuda", 128), (32, "cuda", 64), (80, "cuda", 128),
                                                          (128, "cuda", 128), (192, "cuda", 256), (256, "cuda", 256),
                                                          (96, "cpu", 96), (256, "cpu", 256)])
def test_kernel_head_dim(head_dim, device_type, runs_at):
    from ds_mtraining.attention import kernel_head_dim
    assert kernel_head_dim(head_dim, device_type) == runs_at


def test_models_md_holds_the_matrix():
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "docs" / "MODELS.md").read_text()
    assert markdown_table(matrix_rows()) in text, "regenerate with: python -m ds_mtraining.families"
