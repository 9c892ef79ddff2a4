"""PyTorch's single-thread f32 products on the shapes `ds-rs bench gemm --peer PYTHON` times.

Usage: gemm_torch.py SHAPES_JSON ITERS
SHAPES_JSON: [{"name", "rows", "k", "n"}, ...]; each product is x [rows, k] @ W[n, k].T, as a
linear layer's forward (torch.nn.functional.linear). Prints a JSON list: the median seconds of
each, after 3 untimed repetitions.
"""

import json
import sys
import time

import torch


def median_seconds(rows, k, n, iters):
    x = torch.randn(rows, k, dtype=torch.float32)
    w = torch.randn(n, k, dtype=torch.float32)
    times = []
    for i in range(iters + 3):
        t = time.perf_counter()
        torch.nn.functional.linear(x, w)
        if i >= 3:
            times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def main():
    torch.set_num_threads(1)
    shapes = json.loads(sys.argv[1])
    iters = int(sys.argv[2])
    print(json.dumps([median_seconds(s["rows"], s["k"], s["n"], iters) for s in shapes]))


if __name__ == "__main__":
    main()
