#!/usr/bin/env python3
"""PyTorch's side of `ds-rs bench attention` (issue 35): causal
torch.nn.functional.scaled_dot_product_attention, forward and backward, at one shape: q
[B, H, T, hd], k and v [B, G, T, hd] (grouped heads repeated over the query heads that share
them), the output's gradient random. On a GPU in bf16 PyTorch picks its flash kernel. FLOPs as
ds-rs counts them: FlashAttention's 4 B H T^2 hd for the forward, halved by the causal mask,
and 2.5 times that for the backward.

  python scripts/bench/attention_torch.py --device cuda --dtype bf16 --batch 16 --heads 12 --seq-len 1024

Prints one JSON line in the shape of `ds-rs bench attention --json` (path "torch-sdpa").
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=["f32", "bf16", "f16"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    dev = torch.device(a.device)
    name = a.dtype or ("f32" if dev.type == "cpu" else "bf16")
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[name]
    b, h, t, hd = a.batch, a.heads, a.seq_len, a.head_dim
    g = a.kv_heads or h
    if h % g:
        raise SystemExit(f"--kv-heads {g} must divide --heads {h}")

    def rand(*shape):
        return torch.randn(*shape, device=dev, dtype=dtype, requires_grad=True)

    q, k, v = rand(b, h, t, hd), rand(b, g, t, hd), rand(b, g, t, hd)
    dout = torch.randn(b, h, t, hd, device=dev, dtype=dtype)

    def step():
        kk = k.repeat_interleave(h // g, dim=1)
        vv = v.repeat_interleave(h // g, dim=1)
        out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
        return torch.autograd.grad(out, (q, k, v), dout)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    times = []
    for i in range(a.warmup + max(a.iters, 1)):
        sync()
        start = time.perf_counter()
        step()
        sync()
        if i >= a.warmup:
            times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    median = times[len(times) // 2]
    flops = 4.0 * b * h * t * t * hd / 2.0 * 3.5
    print(json.dumps({"bench": "attention", "path": "torch-sdpa", "batch": b, "heads": h,
                      "kv_heads": g, "seq_len": t, "head_dim": hd, "dtype": name,
                      "median_ms": median, "min_ms": times[0],
                      "tflops": flops / (median * 1e-3) / 1e12, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
