#!/usr/bin/env python3
"""DeepSpeed-Ulysses on the CPU, the peer of ds-rs's `--sp` (issue 38): ../shared/bench/gpt.py's
GPT whose attention runs through DeepSpeed 0.19.8's `deepspeed.sequence.layer.DistributedAttention`
(the all-to-all from a rank's positions to its heads and back) over the sequence-parallel groups
of `deepspeed.runtime.sequence_parallel.parallel_state_sp`, trained by DeepSpeed with that mpu
on gloo. Every rank of a group reads the same samples of the peer benchmark's tokens (one
replica: `gpt.TokenBatches(rank=0, world=1)`) and keeps its T/sp positions, its learned
positions offset; its loss is the sum of its positions' cross-entropy over the batch's
positions, which DeepSpeed's gradient reduction (summed over the sequence-parallel ranks,
averaged over the replicas) turns into the samples' mean. Prints one JSON line (rank 0) with
each step's loss, the sum over the group.

  torchrun --standalone --nproc_per_node 2 ulysses_peer.py --model m.json --init w.safetensors \
      --ds-config c.json --steps 5
"""
import argparse
import json
import math
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.environ.get("DS_RS_BENCH", os.path.join(os.path.dirname(__file__), "../../../shared/bench")))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from deepspeed.runtime.sequence_parallel import parallel_state_sp as sp_state  # noqa: E402
from deepspeed.sequence.layer import DistributedAttention  # noqa: E402

import gpt  # noqa: E402
from make_tokens import ensure_tokens  # noqa: E402


def causal_attention(q, k, v):
    """[B, T, h, hd] whole sequences of a rank's heads to the same shape."""
    hd = q.shape[-1]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(hd))
    return y.transpose(1, 2)


class UlyssesAttention(torch.nn.Module):
    """gpt.py's attention with its core behind DeepSpeed's DistributedAttention."""

    def __init__(self, attn, group):
        super().__init__()
        self.c_attn, self.c_proj, self.H = attn.c_attn, attn.c_proj, attn.H
        self.dist = DistributedAttention(causal_attention, group, scatter_idx=2, gather_idx=1)

    def forward(self, x):
        B, T, d = x.shape  # this rank's T/sp positions
        q, k, v = self.c_attn(x).split(d, dim=2)
        heads = lambda t: t.view(B, T, self.H, d // self.H)  # noqa: E731
        y = self.dist(heads(q), heads(k), heads(v), 0)
        return self.c_proj(y.reshape(B, T, d))


class UlyssesGpt(gpt.GPT):
    def forward(self, idx, targets):
        B, T = idx.shape
        offset = sp_state.get_sequence_parallel_rank() * T
        pos = torch.arange(offset, offset + T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.h:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, self.V), targets.reshape(-1), reduction="sum")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a model JSON {V, T, d, H, L}")
    ap.add_argument("--init", required=True, help="the initial weights (safetensors)")
    ap.add_argument("--ds-config", required=True)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    with open(a.ds_config) as f:
        ds_config = json.load(f)
    deepspeed.init_distributed()
    sp = ds_config["sequence_parallel_size"]
    sp_state.initialize_sequence_parallel(sp)
    group = sp_state.get_sequence_parallel_group()
    rank = sp_state.get_sequence_parallel_rank()
    gpt.set_threads()
    with open(a.model) as f:
        cfg = {k: int(v) for k, v in json.load(f).items() if k in ("V", "T", "d", "H", "L")}
    torch.manual_seed(0)
    model = UlyssesGpt(cfg["V"], cfg["T"], cfg["d"], cfg["H"], cfg["L"])
    gpt.load_init(model, a.init)
    for blk in model.h:
        blk.attn = UlyssesAttention(blk.attn, group)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config, mpu=sp_state)
    mb = engine.train_micro_batch_size_per_gpu()
    data = gpt.TokenBatches(ensure_tokens(cfg["V"]), cfg["T"], mb, 0, 1)
    local = cfg["T"] // sp
    losses = []
    for step in range(a.steps):
        x, y = data.get(step)
        x, y = (t[:, rank * local:(rank + 1) * local].contiguous() for t in (x, y))
        loss = engine(x, y) / (mb * cfg["T"])
        engine.backward(loss)
        engine.step()
        whole = loss.detach().clone()
        dist.all_reduce(whole, group=group)
        losses.append(whole.item())
    if dist.get_rank() == 0:
        print(json.dumps(dict(impl="deepspeed-ulysses", sp=sp, world=dist.get_world_size(),
                              comm_backend=dist.get_backend(), losses=losses)))
    dist.barrier()


if __name__ == "__main__":
    main()
