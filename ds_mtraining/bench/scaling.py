"""Ring scaling benchmark: the sparse ring's forward + backward on W ranks vs one device running
the same sparse attention on the whole sequence, and where the ring's time goes.

For each sequence length it draws q, k, v, dout [1, S, H, D] (bf16 on GPU, fp32 on CPU) and
estimates a vertical-slash index once with the project's distributed estimator, its slash budget
calibrated to ``--density`` (random q/k spread the last rows' mass evenly, so top-p selects up to
the caps: ``max_slash_diagonals`` sets the density). Then, per mode and ring:

* ``given_index``: the ring with that index; ``per_call_estimation``: the ring estimating the
  index from the shards in every call (index=None, same budgets; on GPUs the fused estimator
  replayed from its CUDA graph); ``per_call_estimation_eager``: the same without the graph
  (``DS_MTRAINING_ESTIMATOR_GRAPHS=0``: every launch from the host);
* ``flat`` ring, and the ``hierarchical`` one when the launcher started more than one node
  (two fake nodes on one machine through a hostfile, below);
* one-device baseline: rank 0 alone (the others wait) runs ``sparse_attention`` on the whole
  sequence with the same index (or estimating it per call), timed in the same run.

efficiency = T_1 / (W x T_ring), T_ring the median over repeats of the slowest rank's step (CUDA
events; wall clock on CPU). An instrumented pass then times, per rank and ring step, the sparse
kernels, the waits on transfers, the estimation and the ranks' agreement check (CUDA events
around those calls); ``other`` = wall - all of those (launches, allocations, casts, dK/dV
accumulation, host syncs). The out/LSE merge and the dQ sum run in the kernels' epilogues, so
their cost is in the kernels' time, where the ring's kernels exceed the same kernels alone. Each
step's kernels are also timed alone (no transfer in flight), which separates the cost of
splitting the work from interference by concurrent NCCL traffic. Measured imbalance: worker
level = max / mean over ranks of the kernel time; the ring-step tables give
:func:`ds_mtraining.ring.work.imbalance`'s metrics, next to the index's prediction
(:func:`~ds_mtraining.ring.work.pair_work`).

Launch (the form is recorded in the JSON):

    torchrun --nproc_per_node 2 -m ds_mtraining.bench.scaling --out OUT
    deepspeed --num_gpus 2 --module ds_mtraining.bench.scaling --out OUT
    # two fake nodes x 1 GPU (flat and hierarchical ring), one command per node N = 0, 1:
    deepspeed --hostfile H --include node0:0@node1:1 --no_ssh --node_rank N \\
        --master_addr 127.0.0.1 --master_port P --module ds_mtraining.bench.scaling --out ...
    # CPU smoke test (gloo, tiny sizes):
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 -m ds_mtraining.bench.scaling --smoke

Writes OUT/multi_gpu_<device>x<W>.json (e.g. multi_gpu_h200x2.json), merging
with the cases of an earlier launch form already there, and prints a table.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from .. import ops
from ..attention import resolve_softmax_scale, sparse_attention
from ..config import SparseConfig, slash_cap_for_blocks
from ..distributed import shutdown
from ..index import Stripe
from ..distributed import comm as ring_comm
from ..distributed.comm import RingComm
from ..distributed.topology import Topology, create_hierarchical_groups
from ..estimator import estimate_index, graphs as estimate_graph
from ..estimator.distributed import estimate_vertical_slash_distributed
from ..layout import StripedLayout
from ..record import result_record, write_json
from ..ring import ring_sparse_attention
from ..ring.work import imbalance, pair_work, step_work
from . import params_of

MODES = ("given_index", "per_call_estimation", "per_call_estimation_eager")
RINGS = ("flat", "hierarchical")
SMOKE = dict(seq_lens=[1024, 2048], heads=4, kv_heads=2, head_dim=32, block_size=64, warmup=1,
             repeats=2, max_vertical=16)
# spans of the instrumented pass: category -> names of the functions timed, found (by identity)
# in every loaded ds_mtraining module, so a restructured ring module is still instrumented
CATEGORIES = ("kernel", "comm_wait", "estimate", "agreement")


# ---------------------------------------------------------------------- clocks and spans
class Clock:
    """CUDA events on GPU, ``time.perf_counter`` on CPU (where the ops are synchronous)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3


class Spans:
    """(category, start, end) of the wrapped calls, in call order; a wrapped call inside another
    (e.g. a transfer wait inside the estimation) counts towards the outer one only."""

    def __init__(self, clock: Clock):
        self.clock, self.items, self.depth = clock, [], 0

    def wrap(self, category: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            start = self.clock.now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.items.append((category, start, self.clock.now()))
                self.depth -= 1
        return timed

    def resolved(self) -> list[tuple[str, float]]:
        return [(category, self.clock.ms(start, end)) for category, start, end in self.items]


@contextlib.contextmanager
def instrumented(spans: Spans):
    """Wraps, for the duration, the ring's kernels (``ops.attention_forward/backward``, and
    ``ops.attention_delta``, which the ring runs once per backward where a single call computes it
    inside its backward), transfer waits (``PendingRotation.wait``), distributed estimation and
    rank-agreement check wherever a ds_mtraining module holds them."""
    targets = {"attention_forward": "kernel_fwd", "attention_backward": "kernel_bwd",
               "attention_delta": "kernel_delta", "estimate_index": "estimate", "check_ranks_agree": "agreement"}
    originals = {name: {getattr(module, name) for module in _our_modules()
                        if callable(getattr(module, name, None))} for name in targets}
    patched = []
    for module in _our_modules():
        for name, category in targets.items():
            value = getattr(module, name, None)
            if value is not None and value in originals[name]:
                setattr(module, name, spans.wrap(category, value))
                patched.append((module, name, value))
    wait = ring_comm.PendingRotation.wait
    ring_comm.PendingRotation.wait = spans.wrap("comm_wait", wait)
    try:
        yield
    finally:
        ring_comm.PendingRotation.wait = wait
        for module, name, value in patched:
            setattr(module, name, value)


def _our_modules():
    return [m for n, m in list(sys.modules.items()) if n.startswith("ds_mtraining") and m is not None]


# ---------------------------------------------------------------------- setup
def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()), formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="--smoke sets " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in SMOKE.items()))
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[131072, 262144, 524288],
                        help="total sequence lengths (multiples of world x block)")
    parser.add_argument("--heads", type=int, default=16, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    parser.add_argument("--head-dim", type=int, default=128, help="head dimension (ds_mtraining.ops.CUDA_HEAD_DIMS on GPU)")
    parser.add_argument("--block-size", type=int, default=128, help="kernel block = stripe width")
    parser.add_argument("--density", type=float, default=0.05, help="target density of the index")
    parser.add_argument("--max-vertical", type=int, default=256, help="vertical column budget per head")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="index given to each call, or estimated in each call (from a CUDA graph, or eagerly)")
    parser.add_argument("--rings", nargs="+", choices=RINGS + ("auto",), default=["auto"],
                        help="auto: flat, plus hierarchical when the launcher started several nodes")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls before each timing")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls (median)")
    parser.add_argument("--no-breakdown", action="store_true",
                        help="skip the instrumented pass and the per-step kernels alone")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU smoke test)")
    parser.add_argument("--cpu", action="store_true", help="run on CPU (gloo) even if CUDA is available")
    parser.add_argument("--hostfile", default=None, help="nodes x slots from a hostfile instead of the launcher's env")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before a stuck collective fails")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random q/k/v/dout")
    parser.add_argument("--out", default=None,
                        help="output directory; None: a fresh runs/scaling/<UTC time>")
    parser.add_argument("--local_rank", type=int, default=None, help="(set by the deepspeed launcher)")
    args = parser.parse_args(argv)
    if args.smoke:
        given = {a.dest for a in parser._actions if a.option_strings
                 and any(s in (argv if argv is not None else sys.argv[1:]) for s in a.option_strings)}
        for key, value in SMOKE.items():
            if key not in given:
                setattr(args, key, value)
    return args


def launcher_name() -> str:
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "torchrun"
    if "CROSS_SIZE" in os.environ or "LOCAL_SIZE" in os.environ:
        return "deepspeed"
    if "OMPI_COMM_WORLD_SIZE" in os.environ:
        return "mpirun"
    return "env"


def barrier(device):
    """All ranks here, and this device idle (a small all-reduce instead of dist.barrier, which
    with NCCL guesses a device)."""
    token = torch.zeros(1, device=device)
    dist.all_reduce(token)
    if device.type == "cuda":
        torch.cuda.synchronize()


def setup(args):
    cuda = torch.cuda.is_available() and not args.cpu
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if "RANK" not in os.environ:
        raise SystemExit("ds_mtraining.bench.scaling: start it with a launcher (torchrun --nproc_per_node 2, "
                         "deepspeed --num_gpus 2, or a hostfile); see --help")
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout))
    world = dist.get_world_size()
    if world < 2:
        raise SystemExit("ds_mtraining.bench.scaling needs at least 2 ranks")
    topology = Topology.from_env(world, args.hostfile)
    rings = [r for r in RINGS if r in args.rings or ("auto" in args.rings and (r == "flat" or topology.nodes > 1))]
    hierarchy = (create_hierarchical_groups(topology, [list(range(world))])
                 if "hierarchical" in rings else None)
    launch = {"launcher": launcher_name(), "nodes": topology.nodes, "per_node": topology.per_node,
              "form": (f"{topology.nodes} nodes x {topology.per_node} (hostfile)" if topology.nodes > 1
                       else f"1 node x {topology.per_node}"),
              "host": socket.gethostname(), "master_addr": os.environ.get("MASTER_ADDR")}
    return device, torch.bfloat16 if cuda else torch.float32, topology, rings, hierarchy, launch


def out_dir(args) -> Path:
    """--out, or a fresh runs/scaling/<UTC time> chosen by rank 0."""
    choice = [args.out]
    if args.out is None and dist.get_rank() == 0:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        base = Path("runs", "scaling", stamp)
        path, n = base, 1
        while path.exists():
            path, n = base.with_name(f"{stamp}-{n}"), n + 1
        choice = [str(path)]
    dist.broadcast_object_list(choice, src=0)
    return Path(choice[0])


def device_tag(device) -> str:
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower().replace("nvidia", "").strip()
    return "".join(c for c in name.split()[0] if c.isalnum()) or "gpu"


# ---------------------------------------------------------------------- one case
def ring_order(world: int, rank: int, topology: Topology, ring: str) -> list[int]:
    """Key rank of each ring step of this rank (the flat ring, or outer x inner steps)."""
    if ring == "flat" or topology.nodes == 1:
        return [(rank - t) % world for t in range(world)]
    g, node, local = topology.per_node, rank // topology.per_node, rank % topology.per_node
    return [((node - o) % topology.nodes) * g + (local - i) % g
            for o in range(topology.nodes) for i in range(g)]


def timed(fn, clock: Clock, device, warmup: int, repeats: int, everyone: bool = True):
    """Per repeat (after ``warmup`` calls): device ms and host ms (until ``fn`` returned) of ``fn()``;
    ``everyone``: all ranks start each repeat together."""
    for _ in range(warmup):
        fn()
    device_ms, host_ms = [], []
    for _ in range(repeats):
        if everyone:
            barrier(device)
        clock.sync()
        start, host = clock.now(), time.perf_counter()
        fn()
        host = time.perf_counter() - host
        end = clock.now()
        clock.sync()
        device_ms.append(clock.ms(start, end))
        host_ms.append(host * 1e3)
    return device_ms, host_ms


def calibrated_index(q, k, seq_len, args, device, comm, scale):
    """(config, index) from the distributed estimator on the shards, ``max_slash_diagonals`` scaled until the
    density is within 10% of --density (every rank holds the same index, so decides alike)."""
    nb = seq_len // args.block_size
    slash = max(1, round(args.density * nb))  # in block diagonals
    for _ in range(4):
        config = SparseConfig(block_size=args.block_size, max_vertical=args.max_vertical,
                              max_slash_diagonals=slash_cap_for_blocks(slash))
        index = estimate_vertical_slash_distributed(q, k, config, comm, scale)
        density = index.density()
        better = max(1, min(nb, round(slash * args.density / max(density, 1e-9))))
        if abs(density / args.density - 1) <= 0.1 or better == slash:
            break
        slash = better
    return config, index, density


def fwd_bwd(attention, inputs, dout):
    q, k, v = (t.detach().requires_grad_() for t in inputs)
    attention(q, k, v).backward(dout)


def run_case(seq_len, args, device, dtype, topology, rings, hierarchy, clock, launch):
    rank, world = dist.get_rank(), dist.get_world_size()
    h, hkv, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    g = torch.Generator(device=device).manual_seed(args.seed + seq_len)
    full = [torch.randn(1, seq_len, heads, d, generator=g, device=device, dtype=dtype)
            for heads in (h, hkv, hkv, h)]
    layout = StripedLayout(world, bs)
    shards = [layout.shard(t, rank).contiguous() for t in full]
    scale = resolve_softmax_scale(d)
    comm = RingComm()
    config, index, density = calibrated_index(shards[0], shards[1], seq_len, args, device, comm, scale)
    if rank != 0:
        del full  # only rank 0 runs the one-device baseline
        full = None
    predicted = imbalance(step_work(pair_work(index, layout).cpu()))
    cases = []
    for mode in args.modes:
        given = index if mode == "given_index" else None
        os.environ[estimate_graph.ENV] = "0" if mode == "per_call_estimation_eager" else "1"
        # one-device baseline, rank 0 alone, the others waiting
        baseline = {}
        if rank == 0:
            def single(q, k, v):
                idx = given if given is not None else estimate_index(q.detach(), k.detach(), config, None, scale)
                return sparse_attention(q, k, v, idx, scale)
            t1, t1_host = timed(lambda: fwd_bwd(single, full[:3], full[3]), clock, device,
                                args.warmup, args.repeats, everyone=False)

            def kernels_only():
                out, lse = ops.attention_forward(full[0], full[1], full[2], index, scale)
                ops.attention_backward(full[3], full[0], full[1], full[2], out, lse, index, scale)
            t1k, _ = timed(kernels_only, clock, device, 1, args.repeats, everyone=False)
            t1e = [0.0]
            if given is None:
                t1e, _ = timed(lambda: estimate_index(full[0], full[1], config, None, scale), clock, device,
                               1, args.repeats, everyone=False)
            baseline = dict(one_gpu_ms=statistics.median(t1), one_gpu_host_ms=statistics.median(t1_host),
                            one_gpu_kernel_ms=statistics.median(t1k), one_gpu_estimate_ms=statistics.median(t1e),
                            one_gpu_ms_all=t1)
        barrier(device)
        for ring in rings:
            hier = hierarchy if ring == "hierarchical" else None

            def attention(q, k, v):
                return ring_sparse_attention(q, k, v, config, softmax_scale=scale, index=given, hierarchy=hier)
            step = lambda: fwd_bwd(attention, shards[:3], shards[3])  # noqa: E731
            ring_ms, host_ms = timed(step, clock, device, args.warmup, args.repeats)
            mine = dict(ring_ms=ring_ms, host_ms=host_ms)
            if not args.no_breakdown:
                mine.update(breakdown(step, shards, index, scale, clock, device, args,
                                      ring_order(world, rank, topology, ring)))
            gathered = [None] * world
            dist.all_gather_object(gathered, mine)
            if rank == 0:
                cases.append(summarise(seq_len, mode, ring, launch, world, density, config, baseline,
                                       gathered, predicted))
            barrier(device)
    return cases


def breakdown(step, shards, index, scale, clock, device, args, order) -> dict:
    """This rank's instrumented ring step (mean of 2) and each ring step's kernels alone."""
    passes = []
    for _ in range(2):
        spans = Spans(clock)
        barrier(device)
        with instrumented(spans):
            start = clock.now()
            step()
            end = clock.now()
        clock.sync()
        passes.append((clock.ms(start, end), spans.resolved()))
    wall = statistics.fmean(w for w, _ in passes)
    totals = {c: 0.0 for c in CATEGORIES}
    fwd, bwd = [0.0] * len(order), [0.0] * len(order)
    found = set()
    for _, items in passes:
        f = [ms for c, ms in items if c == "kernel_fwd"]
        b = [ms for c, ms in items if c == "kernel_bwd"]
        if len(f) == len(order) and len(b) == len(order):
            fwd = [x + y / len(passes) for x, y in zip(fwd, f)]
            bwd = [x + y / len(passes) for x, y in zip(bwd, b)]
        for category, ms in items:
            category = "kernel" if category.startswith("kernel") else category
            found.add(category)
            totals[category] += ms / len(passes)
    parts = {c: (totals[c] if c in found or c in ("kernel", "comm_wait") else None) for c in CATEGORIES}
    parts["other"] = wall - sum(v for v in parts.values() if v is not None)
    # each ring step's kernels alone: this rank's queries against the keys of that step's rank
    q, k, v, dout = shards
    alone = []
    world, me = len(order), dist.get_rank()
    for key_rank in order:
        stripe = Stripe(world, me, key_rank)
        out, lse = ops.attention_forward(q, k, v, index, scale, stripe)
        f, _ = timed(lambda: ops.attention_forward(q, k, v, index, scale, stripe), clock, device, 1,
                     args.repeats, everyone=False)
        b, _ = timed(lambda: ops.attention_backward(dout, q, k, v, out, lse, index, scale, stripe), clock,
                     device, 1, args.repeats, everyone=False)
        alone.append(statistics.median(f) + statistics.median(b))
    return dict(wall_ms=wall, parts_ms=parts, step_kernel_ms=[x + y for x, y in zip(fwd, bwd)],
                step_kernel_alone_ms=alone)


def summarise(seq_len, mode, ring, launch, world, density, config, baseline, ranks, predicted) -> dict:
    """One case's record from every rank's timings (rank 0)."""
    per_iteration = [max(r["ring_ms"][i] for r in ranks) for i in range(len(ranks[0]["ring_ms"]))]
    t_ring = statistics.median(per_iteration)
    t1 = baseline["one_gpu_ms"]
    times = dict(ring_ms=t_ring, ring_ms_all=per_iteration,
                 ring_ms_per_rank=[statistics.median(r["ring_ms"]) for r in ranks],
                 ring_host_ms_per_rank=[statistics.median(r["host_ms"]) for r in ranks],
                 ideal_ms=t1 / world, **baseline)
    case = dict(seq_len=seq_len, mode=mode, ring=ring, launch=launch["form"], launcher=launch["launcher"],
                world=world, density=density,
                config=config.to_dict(),
                efficiency=t1 / (world * t_ring), times=times,
                imbalance=dict(index_predicted=predicted))
    if "parts_ms" not in ranks[0]:
        return case
    kernel = [r["parts_ms"]["kernel"] for r in ranks]
    alone = [sum(r["step_kernel_alone_ms"]) for r in ranks]
    measured = dict(worker_level=max(kernel) / statistics.fmean(kernel),
                    worker_level_alone=max(alone) / statistics.fmean(alone),
                    wall_level=max(r["wall_ms"] for r in ranks) / statistics.fmean(r["wall_ms"] for r in ranks))
    steps = torch.tensor([r["step_kernel_ms"] for r in ranks], dtype=torch.float64)
    if steps.abs().sum() > 0:
        measured["ring_steps"] = imbalance(steps)
    measured["ring_steps_alone"] = imbalance(torch.tensor([r["step_kernel_alone_ms"] for r in ranks],
                                                          dtype=torch.float64))
    case["imbalance"].update(measured=measured)
    names = list(ranks[0]["parts_ms"])
    mean = {n: (statistics.fmean(r["parts_ms"][n] for r in ranks) if ranks[0]["parts_ms"][n] is not None else None)
            for n in names}
    walls = [r["wall_ms"] for r in ranks]
    # the gap to linear scaling, T_ring - T_1 / W, by cause (ms; means over ranks)
    t1k, t1e = baseline["one_gpu_kernel_ms"], baseline["one_gpu_estimate_ms"]
    gap = dict(total=t_ring - t1 / world,
               kernel_split=statistics.fmean(alone) - t1k / world,
               kernel_interference=mean["kernel"] - statistics.fmean(alone),
               comm_wait=mean["comm_wait"],
               estimate_extra=(mean["estimate"] or 0.0) - t1e / world,
               agreement=mean["agreement"] or 0.0,
               other_extra=mean["other"] - (t1 - t1k - t1e) / world,
               slowest_rank=max(walls) - statistics.fmean(walls))
    gap["instrumentation_and_noise"] = gap["total"] - sum(v for k, v in gap.items() if k != "total")
    case["breakdown"] = dict(mean_ms=mean, wall_ms_per_rank=walls,
                             per_rank_ms=[r["parts_ms"] for r in ranks],
                             step_kernel_ms=[r["step_kernel_ms"] for r in ranks],
                             step_kernel_alone_ms=[r["step_kernel_alone_ms"] for r in ranks],
                             gap_to_linear_ms=gap)
    return case


# ---------------------------------------------------------------------- output
def table(cases) -> str:
    head = (f"{'seq':>7} {'mode':<19} {'ring':<12} {'T1 ms':>8} {'Tring ms':>9} {'eff':>5} {'w-imb':>6} "
            f"{'s-imb':>6} {'kernel':>7} {'alone':>7} {'wait':>6} {'est':>6} {'agree':>6} "
            f"{'other':>6}")
    lines = [head, "-" * len(head)]
    for c in cases:
        t, m = c["times"], c["imbalance"].get("measured", {})
        b = c.get("breakdown", {}).get("mean_ms", {})
        alone = c.get("breakdown", {}).get("step_kernel_alone_ms")

        def f(x, w=6, p=2):
            return f"{x:>{w}.{p}f}" if isinstance(x, (int, float)) else f"{'-':>{w}}"
        lines.append(
            f"{c['seq_len'] // 1024:>6}K {c['mode']:<19} {c['ring']:<12} {f(t['one_gpu_ms'], 8)} "
            f"{f(t['ring_ms'], 9)} {f(c['efficiency'], 5)} {f(m.get('worker_level'), 6, 3)} "
            f"{f(m.get('ring_steps', {}).get('step_level_worst'), 6, 3)} {f(b.get('kernel'), 7)} "
            f"{f(statistics.fmean(map(sum, alone)) if alone else None, 7)} {f(b.get('comm_wait'))} "
            f"{f(b.get('estimate'))} {f(b.get('agreement'))} {f(b.get('other'))}")
    lines.append("eff = T1 / (W x Tring); w-imb = max/mean of per-rank kernel ms; s-imb = worst per-rank "
                 "max/mean over ring steps; kernel..other: mean per-rank ms of the instrumented step "
                 "(alone = the same kernels with no transfer in flight)")
    return "\n".join(lines)


def save_merged(path: Path, record: dict):
    """Writes ``record``, keeping an earlier file's cases (its ``rows``; ``cases`` in files written
    before :mod:`ds_mtraining.record`) of other (seq_len, mode, ring, launch), and its runs."""
    def key(c):
        return (c["seq_len"], c["mode"], c["ring"], c["launch"])
    if path.exists():
        try:
            earlier = json.loads(path.read_text())
            new = {key(c) for c in record["rows"]}
            kept = [c for c in earlier.get("rows", earlier.get("cases", [])) if key(c) not in new]
            record["rows"] = sorted(kept + record["rows"], key=key)
            record["runs"] = earlier.get("runs", []) + record["runs"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            print(f"scaling: {path} is not a results file of this benchmark ({error}); overwriting")
    write_json(path, record)


def main(argv=None):
    args = parse_args(argv)
    if args.smoke or not torch.cuda.is_available():
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device, dtype, topology, rings, hierarchy, launch = setup(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        out = out_dir(args)
        clock = Clock(device)
        if rank == 0:
            print(f"scaling: {world} ranks ({launch['form']}, {launch['launcher']}), {device.type} "
                  f"{str(dtype).removeprefix('torch.')}, rings {rings}, modes {args.modes}, "
                  f"H={args.heads} Hkv={args.kv_heads} D={args.head_dim} block={args.block_size}", flush=True)
        cases = []
        for seq_len in args.seq_lens:
            if seq_len % (world * args.block_size):
                raise SystemExit(f"--seq-lens {seq_len} is not a multiple of world x block = "
                                 f"{world} x {args.block_size}")
            started = time.perf_counter()
            new = run_case(seq_len, args, device, dtype, topology, rings, hierarchy, clock, launch)
            cases += new
            if rank == 0:
                print(table(new).split("\n", 2)[2].rsplit("\n", 1)[0] + f"   ({time.perf_counter() - started:.0f} s)",
                      flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if rank == 0:
            print(table(cases))
            record = result_record(
                "ring_scaling", params_of(args), cases,
                command=" ".join([launch["launcher"], "... -m ds_mtraining.bench.scaling", *sys.argv[1:]]),
                device=(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu") + f" x{world}",
                torch=torch.__version__, world=world,
                shape=dict(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                           block_size=args.block_size, dtype=str(dtype).removeprefix("torch.")),
                index=("estimated once per length by the distributed estimator from random q/k "
                       f"(last_q 64, top-p 0.9), max_slash_diagonals calibrated to density {args.density}, "
                       f"max_vertical {args.max_vertical}"),
                efficiency="T_1gpu / (W x T_ring), T_ring = median over repeats of the slowest rank")
            # the file's commit and this run's: earlier runs keep their own
            record["runs"] = [{**{key: record[key] for key in ("utc", "commit", "dirty", "command")},
                               "launch": launch, "rings": rings, "modes": args.modes}]
            path = out / f"multi_gpu_{device_tag(device)}x{world}.json"
            save_merged(path, record)
            print(f"scaling: wrote {path}", flush=True)
        barrier(device)
    except BaseException:
        print(f"scaling: rank {rank} FAILED:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    finally:
        shutdown()


if __name__ == "__main__":
    main()
