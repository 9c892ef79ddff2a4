#!/usr/bin/env python3
"""The peer of ds-rs's MoE GPT (issue 37): ../shared/bench/gpt.py's GPT whose every
`expert_interval`-th block's MLP is DeepSpeed-MoE's layer (`deepspeed.moe.layer.MoE` of
`num_experts` copies of gpt.py's MLP, ep_size from --ep), trained by DeepSpeed 0.19.8 on the
CPU with the ds_config given, on the peer benchmark's tokens (make_tokens.py), as
train_ds.py trains the dense GPT. The loss is the cross-entropy plus `aux_loss_coef` times
each MoE layer's l_aux, as DeepSpeed-MoE's users add it. Parameter names are ds-rs's
(`h.1.mlp.deepspeed_moe.gate.wg.weight`, ...).

  torchrun --standalone --nproc_per_node 2 gpt_moe_peer.py --model moe.json --ep 2 \
      --ds-config zero2.json --steps 10

The model JSON is ds-rs's: {"V", "T", "d", "H", "L", "moe": {"num_experts", "k",
"capacity_factor", "min_capacity", "drop_tokens", "aux_loss_coef", "expert_interval"}}.
Prints one JSON line (rank 0).
"""
import argparse
import json
import os
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.environ.get("DS_RS_BENCH", os.path.join(os.path.dirname(__file__), "../../../shared/bench")))

import deepspeed  # noqa: E402
import deepspeed.comm as ddist  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.moe.layer import MoE  # noqa: E402
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer  # noqa: E402

import gpt  # noqa: E402
from make_tokens import ensure_tokens  # noqa: E402

MOE_DEFAULTS = dict(k=1, capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=4, drop_tokens=True,
                    aux_loss_coef=0.01, expert_interval=2)


class MoeMlp(MoE):
    """DeepSpeed's layer in the MLP's place: returns the output, keeps l_aux for the loss."""

    def forward(self, x):
        out, self.l_aux, _ = super().forward(x)
        return out


class MoeGpt(gpt.GPT):
    def __init__(self, cfg, moe, ep):
        super().__init__(cfg["V"], cfg["T"], cfg["d"], cfg["H"], cfg["L"])
        self.coef = moe["aux_loss_coef"]
        self.moes = []
        for i, blk in enumerate(self.h):
            if (i + 1) % moe["expert_interval"] == 0:
                layer = MoeMlp(hidden_size=cfg["d"], expert=gpt.MLP(cfg["d"]),
                               num_experts=moe["num_experts"], ep_size=ep, k=moe["k"],
                               capacity_factor=moe["capacity_factor"],
                               eval_capacity_factor=moe["eval_capacity_factor"],
                               min_capacity=moe["min_capacity"], drop_tokens=moe["drop_tokens"],
                               use_rts=False, top2_2nd_expert_sampling=False)
                layer.apply(self._init)
                blk.mlp = layer
                self.moes.append(layer)

    def forward(self, idx, targets):
        loss = super().forward(idx, targets)
        return loss + self.coef * sum(m.l_aux for m in self.moes)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--ds-config", required=True)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    with open(a.ds_config) as f:
        ds_config = json.load(f)
    with open(a.model) as f:
        spec = json.load(f)
    cfg = {k: int(spec[k]) for k in ("V", "T", "d", "H", "L")}
    moe = {**MOE_DEFAULTS, **spec["moe"]}
    T = a.seq_len or cfg["T"]
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    threads = gpt.set_threads()
    torch.manual_seed(0)
    model = MoeGpt(cfg, moe, a.ep)
    params = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "parameters"})
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=ds_config)
    mb = engine.train_micro_batch_size_per_gpu()
    data = gpt.TokenBatches(ensure_tokens(cfg["V"]), T, mb, rank, world)
    times, losses = [], []
    for step in range(a.warmup + a.steps):
        x, y = data.get(step)
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    gathered = [None] * world
    dist.all_gather_object(gathered, dict(rss=gpt.peak_rss_mib(), losses=losses))
    if rank == 0:
        mean = [sum(g["losses"][i] for g in gathered) / world for i in range(len(losses))]
        res = dict(impl="deepspeed-moe", ep=a.ep, world=world, threads_per_rank=threads,
                   micro_batch=mb, params=gpt.n_params(model),
                   **gpt.summarize(times, mean, world * mb * T, a.warmup),
                   peak_rss_mib_per_rank=[round(g["rss"], 1) for g in gathered])
        print(json.dumps(res))
    ddist.barrier()


if __name__ == "__main__":
    main()
