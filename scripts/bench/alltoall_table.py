#!/usr/bin/env python3
"""Summarises alltoall_vs_peer.sh's output: per size, each program's busbw (GB/s) and ds-rs's
over gloo's in the same repetition (the median repetition's ratio).

  python3 scripts/bench/alltoall_table.py runs/alltoall.jsonl
"""
import json
import statistics
import sys
from collections import defaultdict


def main(path):
    rows = [json.loads(line) for line in open(path) if line.startswith("{")]
    bw = defaultdict(dict)  # (rep, prog) -> bytes -> busbw
    for r in rows:
        bw[(r["rep"], r["prog"])][r["bytes"]] = r["busbw_gbs"]
    reps = sorted({rep for rep, _ in bw})
    progs = [p for p in ("dsrs_shm", "dsrs_tcp", "mpi", "gloo") if any((r, p) in bw for r in reps)]
    sizes = sorted({s for (_, p), v in bw.items() if p == "gloo" for s in v})
    print("| bytes | " + " | ".join(f"{p} GB/s" for p in progs) + " | shm/gloo | tcp/gloo |")
    print("| --- |" + " --- |" * (len(progs) + 2))
    for s in sizes:
        med = lambda p: statistics.median(bw[(r, p)][s] for r in reps if s in bw.get((r, p), {}))
        ratio = lambda p: statistics.median(
            bw[(r, p)][s] / bw[(r, "gloo")][s] for r in reps if s in bw.get((r, p), {}) and s in bw[(r, "gloo")])
        cells = [f"{med(p):.2f}" for p in progs]
        print(f"| {s} | " + " | ".join(cells) + f" | {ratio('dsrs_shm'):.2f}x | {ratio('dsrs_tcp'):.2f}x |")


if __name__ == "__main__":
    main(sys.argv[1])
