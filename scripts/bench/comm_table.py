#!/usr/bin/env python3
"""Summarises comm_vs_peer.sh's output: per size, ds-rs TCP busbw against gloo's in the same
repetition, and ds-rs shared memory at 64 MiB against memcpy and the shared-memory bound.

  python3 scripts/bench/comm_table.py runs/comm.jsonl
"""
import json
import sys
from collections import defaultdict

MiB = 1 << 20


def load(path):
    rows = [json.loads(line) for line in open(path) if line.startswith("{")]
    reps = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        rep, prog = r["rep"], r["prog"]
        if r.get("bench") == "memcpy":
            reps[rep]["memcpy"][r["how"]] = r["gbps_rw"]
        elif prog == "gloo_mib":
            reps[rep]["gloo"][r["size_mib"] * MiB] = r["busbw_gbps"]
        elif prog == "gloo_bytes":  # the peer's own script, where it has the size, counts
            reps[rep]["gloo"].setdefault(r["bytes"], r["busbw_gbs"])
        elif prog in ("dsrs_tcp", "dsrs_shm", "dsrs_mpi"):
            reps[rep][prog][r["bytes"]] = r["busbw_gbs"]
        elif prog == "bound":
            reps[rep]["bound"][r["bytes"]] = r["busbw_gbs"]
    return reps


def main(path):
    reps = load(path)
    print("## ds-rs TCP vs gloo: busbw GB/s, ds-rs/gloo (per repetition)\n")
    print("| bytes | " + " | ".join(f"rep {k}" for k in sorted(reps)) + " |")
    print("| --- |" + " --- |" * len(reps))
    sizes = sorted({s for r in reps.values() for s in r["dsrs_tcp"] if s in r["gloo"]})
    worst = {}
    for s in sizes:
        cells = []
        for k in sorted(reps):
            ours, theirs = reps[k]["dsrs_tcp"].get(s), reps[k]["gloo"].get(s)
            if ours is None or theirs is None:
                cells.append("-")
                continue
            worst[k] = min(worst.get(k, 1e9), ours / theirs)
            cells.append(f"{ours:.2f} / {theirs:.3f} = **{ours / theirs:.2f}**")
        print(f"| {s} | " + " | ".join(cells) + " |")
    print("\nsmallest ratio over all sizes, per repetition:", {k: round(v, 2) for k, v in worst.items()})
    print("\n## ds-rs shared memory at 64 MiB: busbw against memcpy (GB/s read+written) and the bound\n")
    for k in sorted(reps):
        r = reps[k]
        shm = r["dsrs_shm"].get(64 * MiB)
        parts = [f"ds-rs shm {shm:.2f} GB/s"]
        parts += [f"{shm / v:.0%} of {how} {v:.1f}" for how, v in r["memcpy"].items()]
        if 64 * MiB in r["bound"]:
            b = r["bound"][64 * MiB]
            parts.append(f"{shm / b:.0%} of the zero-copy bound {b:.2f}")
        print(f"- rep {k}: " + "; ".join(parts))


def mpi_table(reps):
    """The MPI backend beside the built-in transport and gloo, per size (busbw GB/s)."""
    if not any(r["dsrs_mpi"] for r in reps.values()):
        return
    print("\n## ds-rs over MPI vs the built-in transport vs gloo: busbw GB/s (MPI / shm, MPI / gloo)\n")
    for k in sorted(reps):
        r = reps[k]
        print(f"rep {k}\n\n| bytes | MPI | shm | tcp | gloo | MPI/shm | MPI/gloo |\n| --- | --- | --- | --- | --- | --- | --- |")
        for s in sorted(r["dsrs_mpi"]):
            mpi, shm, tcp, gloo = (r[p].get(s) for p in ("dsrs_mpi", "dsrs_shm", "dsrs_tcp", "gloo"))
            cell = lambda v: "-" if v is None else f"{v:.3f}"
            ratio = lambda a, b: "-" if a is None or not b else f"{a / b:.2f}"
            print(f"| {s} | {cell(mpi)} | {cell(shm)} | {cell(tcp)} | {cell(gloo)} | {ratio(mpi, shm)} | {ratio(mpi, gloo)} |")
        print()


if __name__ == "__main__":
    main(sys.argv[1])
    mpi_table(load(sys.argv[1]))
