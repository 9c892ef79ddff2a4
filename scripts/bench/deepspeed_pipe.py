#!/usr/bin/env python3
"""DeepSpeed's pipeline engine training the peer benchmark's GPT (../shared/bench/gpt.py).

The model is gpt.py's, built with its seed, cut into PipelineModule layers: the embeddings
(wte + wpe), the L blocks, the head (ln_f + lm_head); the loss is gpt.py's cross-entropy. One
optimizer step is gradient_accumulation_steps micro-batches of the peer's token stream: at
step s, micro-batch k of the single data-parallel replica reads gpt.TokenBatches' batch
2 s + k (with 2 micro-batches), the samples a dp 2 x micro-batch 2 run reads at step s.

  export PATH=/opt/peer/bin:$PATH DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
  python -m torch.distributed.run --standalone --nproc_per_node 2 deepspeed_pipe.py \
      --model m.json --ds-config pipe.json --steps 5 --save-dir ck [--load-dir ck] [--out res.jsonl]

Prints one JSON line (the losses of every step) on rank 0; --out appends it to a file.
"""
import argparse
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../shared/bench"))

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from deepspeed.pipe import PipelineModule  # noqa: E402

import gpt  # noqa: E402
from make_tokens import ensure_tokens  # noqa: E402


class Embeddings(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.wte, self.wpe = model.wte, model.wpe

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.wte(idx) + self.wpe(pos)


class Head(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x):
        return self.lm_head(self.ln_f(x))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a model JSON {V, T, d, H, L}")
    ap.add_argument("--ds-config", required=True)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--save-dir", default=None)
    ap.add_argument("--load-dir", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tag", default="")
    ap.add_argument("--local_rank", type=int, default=-1)
    a = ap.parse_args()
    with open(a.ds_config) as f:
        ds_config = json.load(f)
    with open(a.model) as f:
        cfg = {k: int(v) for k, v in json.load(f).items() if k in ("V", "T", "d", "H", "L")}
    deepspeed.init_distributed()
    gpt.set_threads()
    whole = gpt.build_model(cfg)
    V = cfg["V"]

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))

    layers = [Embeddings(whole), *whole.h, Head(whole)]
    model = PipelineModule(layers=layers, num_stages=a.stages, loss_fn=loss_fn, partition_method="parameters")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    mb, ga = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    assert engine.grid.data_parallel_size == 1, "one data-parallel replica: every rank is a stage"
    data = gpt.TokenBatches(ensure_tokens(V), cfg["T"], mb)
    start = 0
    if a.load_dir:
        path, _ = engine.load_checkpoint(a.load_dir)
        assert path is not None, f"no DeepSpeed checkpoint in {a.load_dir}"
        start = engine.global_steps
    losses = []
    for step in range(start, start + a.steps):
        batches = iter([data.get(step * ga + k) for k in range(ga)])
        losses.append(engine.train_batch(data_iter=batches).item())
    if a.save_dir:
        engine.save_checkpoint(a.save_dir)
    # the last stage computed the losses
    last = torch.tensor(losses, dtype=torch.float64)
    dist.broadcast(last, src=dist.get_world_size() - 1)
    if dist.get_rank() == 0:
        res = dict(impl="deepspeed-pipe", tag=a.tag, stages=a.stages, micro_batch=mb, micro_batches=ga,
                   start=start, losses=last.tolist())
        print(json.dumps(res))
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(res) + "\n")
    # leave together: a rank exiting while the other still talks aborts in gloo's teardown
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
