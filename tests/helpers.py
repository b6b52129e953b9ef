"""Helpers shared by several test modules (imported as ``helpers``: pytest puts tests/ on sys.path,
and spawned ranks inherit it): tiny transformers models, a real-text token sequence, the dense
reference loss, random ring problems, and the launcher/subprocess plumbing with deadlines."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from ds_mtraining import SparseConfig, SparseIndex
from ds_mtraining.data import ByteTokenizer, stdlib_documents
from ds_mtraining.distributed.spawn import free_port, port_taken
from ds_mtraining.layout import StripedLayout

REPO = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------- tiny HF models
SEQ = 512  # tokens per sequence of :func:`sequence`
SMALL = dict(vocab_size=257, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=False)
MODELS = {"qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(rope_theta=1e6)),
          "llama": (LlamaConfig, LlamaForCausalLM, dict(rope_theta=5e5))}


def tiny_model(kind: str, seed: int = 0, attn: str = "eager"):
    config_class, model_class, extra = MODELS[kind]
    torch.manual_seed(seed)
    return model_class(config_class(**SMALL, **extra, attn_implementation=attn)).float()


def text_tokens(length: int) -> torch.Tensor:
    """``length`` byte tokens of real text: the start of the standard-library corpus's fourth
    document (only the first four documents are read)."""
    ids = ByteTokenizer().encode(stdlib_documents(max_documents=4)[3]["text"])[:length]
    assert len(ids) == length, f"the corpus document holds fewer than {length} bytes"
    return torch.from_numpy(ids).long()


def sequence(batch: int = 1, seq_len: int = SEQ):
    """(input_ids, labels) [batch, seq_len] of real text, labels shifted by one token."""
    tokens = text_tokens(batch * (seq_len + 1)).view(batch, seq_len + 1)
    return tokens[:, :-1], tokens[:, 1:]


def dense_loss(model, input_ids, labels):
    """The reference: HF's own forward over the whole sequence, cross-entropy over full logits."""
    logits = model(input_ids=input_ids).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def summed_grads(model, group) -> dict:
    """Every parameter's gradient summed over ``group`` (as DeepSpeed sums sequence-parallel ranks')."""
    import torch.distributed as dist
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad, group=group)
        grads[name] = grad
    return grads


# ----------------------------------------------------------------------------- ring problems
def ring_inputs(seq_len: int, block: int, seed: int = 0):
    """(q [1, S, 4, 32], k, v [1, S, 2, 32], dout, a random index of 5 block diagonals and 6
    columns per head), seeded."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, seq_len, 4, 32, generator=g)
    k, v = torch.randn(2, 1, seq_len, 2, 32, generator=g)
    dout = torch.randn(1, seq_len, 4, 32, generator=g)
    nb = seq_len // block
    index = SparseIndex.from_blocks(torch.randint(-1, nb, (1, 4, 5), generator=g),
                                    torch.randint(-1, seq_len, (1, 4, 6), generator=g), seq_len, block)
    return q, k, v, dout, index


def visible_mask(index: SparseIndex, doc_start=None, window: int | None = None) -> torch.Tensor:
    """Bool [B, H, S, S]: the entries of ``index`` a query sees within its document (``doc_start``)
    and the last ``window`` keys up to itself: what the kernels compute with those arguments."""
    from ds_mtraining.documents import document_causal_mask
    from ds_mtraining.reference import dense_mask
    mask = dense_mask(index)
    if doc_start is not None:
        mask = mask & document_causal_mask(doc_start)[:, None]
    if window is not None:
        i = torch.arange(index.seq_len)
        mask = mask & (i[None] > i[:, None] - window)
    return mask


def every_entry_config(seq_len: int, block: int) -> SparseConfig:
    """p = 1 and caps >= S: an estimate under this config selects every causal entry."""
    return SparseConfig(block_size=block, last_q=64, p_vertical=1.0, p_slash=1.0, max_vertical=seq_len,
                        max_slash_diagonals=seq_len)


def layout_error(call) -> str | None:
    """The message of the LayoutError that ``call()`` raises, or None if it passes."""
    from ds_mtraining.layer import LayoutError
    try:
        call()
    except LayoutError as error:
        return str(error)
    return None


# ----------------------------------------------------------------------------- processes
def environment(**extra) -> dict:
    """The environment for launched processes: the repository importable, one thread per rank."""
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def start(command, log: Path, env: dict | None = None) -> subprocess.Popen:
    """A launcher in its own session, so that killing its process group ends every rank."""
    return subprocess.Popen(command, cwd=REPO, env=env or environment(), stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def finish(process: subprocess.Popen, log: Path, timeout: float):
    """Waits for a launcher; on timeout kills its whole process group and fails with the log."""
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        pytest.fail(f"still running after {timeout}s (killed):\n{log.read_text()[-3000:]}")
    assert code == 0, f"exited with {code}:\n{log.read_text()[-3000:]}"


def run_to_end(command: list, log: Path, timeout: float, env: dict | None = None):
    """:func:`start` then :func:`finish`; a launch whose ``--master_port`` was taken between
    ``free_port()`` and the launch (EADDRINUSE) runs once more on a fresh port."""
    process = start(command, log, env)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass  # finish() kills and fails
    if process.returncode not in (None, 0) and "--master_port" in command and port_taken(log.read_text()):
        command = list(command)
        command[command.index("--master_port") + 1] = str(free_port())
        process = start(command, log, env)
    finish(process, log, timeout)


def differing_entries(mine: SparseIndex, theirs: SparseIndex) -> tuple[int, int]:
    """(entries selected by one index and not the other, entries of ``theirs``) over the slash
    and vertical lists of every head, padding ignored: how far a fused estimator's index is from
    the one it is compared with."""
    from ds_mtraining.index import PAD
    differing = total = 0
    for a_list, b_list in ((mine.slash, theirs.slash), (mine.vertical, theirs.vertical)):
        for a, b in zip(a_list.reshape(-1, a_list.shape[-1]).tolist(), b_list.reshape(-1, b_list.shape[-1]).tolist()):
            a, b = {x for x in a if x != PAD}, {x for x in b if x != PAD}
            differing += len(a ^ b)
            total += len(b)
    return differing, total


class TorchPasses:
    """Torch versions of ds_mtraining.estimator.fused's row_stats, masses, select_top_p_padded_pair,
    merge_columns and build_index."""

    @staticmethod
    def _logits(q_last, k, q_start, seq_len, scale, world, rank, block):
        from ds_mtraining.estimator.rule import last_query_scores
        q_pos = torch.arange(q_start, seq_len, device=q_last.device)
        k_pos = (torch.arange(seq_len, device=q_last.device) if world == 1  # one device: any length
                 else StripedLayout(world, block).positions(seq_len, rank, device=q_last.device))
        return last_query_scores(q_last, k, q_pos, k_pos, scale), q_pos, k_pos

    @staticmethod
    def row_stats(q_last, k, q_start, seq_len, scale, world=1, rank=0, block=64):
        logits = TorchPasses._logits(q_last, k, q_start, seq_len, scale, world, rank, block)[0]
        row_max = logits.amax(-1)
        finite = torch.where(torch.isfinite(row_max), row_max, 0.0)
        return row_max, torch.exp(logits - finite[..., None]).sum(-1)

    @staticmethod
    def masses(q_last, k, row_max, row_sum, q_start, seq_len, scale, world=1, rank=0, block=64):
        logits, q_pos, k_pos = TorchPasses._logits(q_last, k, q_start, seq_len, scale, world, rank, block)
        probs = torch.exp(logits - row_max[..., None]) / row_sum[..., None]
        lq = q_pos.numel()
        t = q_pos[:, None] - k_pos[None, :]
        flat = torch.where(t >= 0, probs, 0.0).flatten(-2)
        shares = torch.zeros(*probs.shape[:2], seq_len, device=probs.device).scatter_add_(
            -1, t.clamp(min=0).flatten().expand_as(flat), flat)
        return probs.sum(-2) / lq, shares / lq

    @staticmethod
    def select_top_p_padded_pair(mass_a, p_a, cap_a, mass_b, p_b, cap_b):
        return TorchPasses._select(mass_a, p_a, cap_a), TorchPasses._select(mass_b, p_b, cap_b)

    @staticmethod
    def _select(mass, p, cap):
        """select_top_p's entries as the CUDA select returns them: ascending, PAD padded to
        min(cap, n), with counts (int32)."""
        from ds_mtraining.estimator.rule import select_top_p
        from ds_mtraining.index import PAD
        chosen = select_top_p(mass, p, cap)
        width = min(cap, mass.shape[-1])
        count = (chosen >= 0).sum(-1)
        chosen = torch.where(chosen >= 0, chosen, PAD).sort(-1).values
        padded = torch.full((*chosen.shape[:-1], width), PAD, dtype=chosen.dtype, device=chosen.device)
        padded[..., :chosen.shape[-1]] = chosen
        return padded.int(), count.int()

    @staticmethod
    def merge_columns(selected, count, extra):
        """The union of each row's first ``count`` selected columns and its batch row's extra
        columns (PAD padded), as the CUDA merge returns it: ascending, PAD padded to a + e."""
        from ds_mtraining.index import PAD
        b, h, a = selected.shape
        merged = torch.full((b, h, a + extra.shape[-1]), PAD, dtype=torch.int32)
        counts = torch.zeros(b, h, dtype=torch.int32)
        for row in range(b):
            for head in range(h):
                union = sorted(set(selected[row, head, :int(count[row, head])].tolist())
                               | {c for c in extra[row].tolist() if c != PAD})
                merged[row, head, :len(union)] = torch.tensor(union, dtype=torch.int32)
                counts[row, head] = len(union)
        return merged.to(selected.device), counts.to(selected.device)

    @staticmethod
    def build_index(slash, slash_count, vertical, vertical_count, seq_len, config):
        from ds_mtraining.estimator.rule import sink_columns
        from ds_mtraining.index import PAD
        b, h = slash.shape[:2]
        slash = torch.where(slash == PAD, -1, slash).long()
        vertical = torch.where(vertical == PAD, -1, vertical).long()
        vertical = torch.cat([vertical, sink_columns(b, h, config, seq_len, slash.device)], -1)
        return SparseIndex.from_vertical_slash(vertical, slash, seq_len, config.block_size,
                                               config.local_blocks)
