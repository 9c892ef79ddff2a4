#!/usr/bin/env python3
"""PyTorch eager's peak device memory in a run of the peer benchmark (issue 35's memory row).

    python torch_memory.py OUT.jsonl [train_torch.py's arguments...]

Runs train_torch.py (../shared/bench, from the current directory) with the arguments after
OUT, then appends one JSON line to OUT: the preset, the micro-batch, and
torch.cuda.max_memory_allocated / max_memory_reserved in MiB. train_torch.py itself reports
no memory; this reads PyTorch's counters after its run, in the same process.
"""
import argparse
import json
import os
import runpy
import sys

import torch


def main():
    out, args = sys.argv[1], sys.argv[2:]
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--micro-batch", type=int, default=8)
    known, _ = ap.parse_known_args(args)
    sys.path.insert(0, os.getcwd())  # train_torch.py imports gpt and make_tokens beside it
    sys.argv = ["train_torch.py"] + args
    runpy.run_path("train_torch.py", run_name="__main__")
    if not torch.cuda.is_available():
        sys.exit("torch_memory: no GPU, so no device memory to report")
    mib = 1 << 20
    row = {
        "preset": known.preset,
        "micro_batch": known.micro_batch,
        "max_memory_allocated_mib": torch.cuda.max_memory_allocated() / mib,
        "max_memory_reserved_mib": torch.cuda.max_memory_reserved() / mib,
    }
    print(json.dumps(row))
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
