"""SM clock and power while each side of the documents case runs back to back (the kernel
benchmark's index and documents at 128K, both sides masked by them): ours, then FlexAttention,
twice, 60 timed fwd+bwd each, with nvidia-smi sampling every 50 ms (docs/CUDA_NOTES.md, "ncu: the
documents case"):

    python3 benchmarks/probes/power_probe.py [--density 0.05] [--samples OUT.csv] [--out OUT.json]

Prints each phase's median time and, per phase, the samples' SM clock (median, lowest), power
(median, highest) and clock-throttle reasons (0x4: the software power cap); --out also writes them
as JSON.
"""
import argparse
import datetime
import statistics
import subprocess
import time

import torch

from ds_mtraining.bench import time_ms
from ds_mtraining.bench.kernel import fwd_bwd_pair
from ds_mtraining.record import result_record, write_json

SEQ, DOCUMENTS = 131072, (4096, 32768)
QUERY = "timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active"


def phase_summary(samples, start, end) -> dict:
    """The samples of one phase, skipping its first 0.3 s (the warm-up runs)."""
    inside = [s for s in samples if start + 0.3 <= s[0] <= end]
    if not inside:
        return {"samples": 0}
    clocks, watts = [s[1] for s in inside], [s[2] for s in inside]
    return {"samples": len(inside), "sm_clock_mhz_median": statistics.median(clocks), "sm_clock_mhz_lowest": min(clocks),
            "power_w_median": statistics.median(watts), "power_w_highest": max(watts),
            "throttle_reasons": sorted({s[3] for s in inside})}


def read_samples(path):
    samples = []
    for line in open(path):
        fields = [f.strip() for f in line.split(",")]
        if len(fields) >= 4:  # timestamp, clock, power, ..., throttle reasons
            when = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=datetime.timezone.utc)
            samples.append((when.timestamp(), float(fields[1].split()[0]), float(fields[2].split()[0]), fields[-1]))
    return samples


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--density", type=float, default=0.05)
    parser.add_argument("--samples", default="/tmp/power_probe.csv", help="nvidia-smi's samples (CSV)")
    parser.add_argument("--out", default=None, help="the phases as JSON")
    args = parser.parse_args()
    sides, described = fwd_bwd_pair(SEQ, args.density, DOCUMENTS)
    print(described)
    for run in sides.values():  # compiles flex, loads our op
        run()
    torch.cuda.synchronize()
    with open(args.samples, "w") as out:
        sampler = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader", "-lms", "50"], stdout=out)
        time.sleep(1)
        phases = []
        for name in ("ours", "flex", "ours", "flex"):
            start = time.time()
            ms = time_ms(sides[name], warmup=3, repeats=60)
            phases.append((name, ms, start, time.time()))
            time.sleep(1)  # a pause between phases
        sampler.terminate()
        sampler.wait()
    samples = read_samples(args.samples)
    rows = [{"side": name, "fwd_bwd_ms": ms, **phase_summary(samples, start, end)} for name, ms, start, end in phases]
    for row in rows:
        print(row)
    if args.out:
        write_json(args.out, result_record("power", vars(args), rows, seq_len=SEQ, documents=DOCUMENTS))


if __name__ == "__main__":
    main()
