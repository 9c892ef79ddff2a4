#!/usr/bin/env python3
"""The peer of `ds-rs train --model DIR`: DeepSpeed 0.19.8 training transformers' model of
the same Hugging Face directory (LlamaForCausalLM, MixtralForCausalLM, ...: AutoModelForCausalLM),
on CPU (fp32), with the same ds_config, on the peer benchmark's token stream
(../shared/bench/make_tokens.py), windows of seq + 1 tokens taken in order and split over the
ranks as ds-rs splits them.

  DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 \
      scripts/bench/hf_peer.py --model DIR --seq-len 256 --ds-config cfg.json

Prints one JSON line: median tokens/s over the timed steps, the losses (mean over the ranks),
peak RSS per rank. --save-dir / --load-dir save and resume DeepSpeed checkpoints (as train_ds.py).
"""
import argparse
import json
import os
import resource
import statistics
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--ds-config", required=True)
    ap.add_argument("--tokens", required=True, help="a uint16 token file")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--save-dir", default=None, help="after the last step, save a DeepSpeed checkpoint here")
    ap.add_argument("--load-dir", default=None, help="first load the newest DeepSpeed checkpoint here and go on from its step")
    a = ap.parse_args()
    with open(a.ds_config) as f:
        ds_config = json.load(f)
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    n = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if n > 0:
        torch.set_num_threads(n)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, attn_implementation=a.attn)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    mb = engine.train_micro_batch_size_per_gpu()
    t = a.seq_len
    tokens = np.fromfile(a.tokens, dtype="<u2").astype(np.int64)
    windows = len(tokens) // (t + 1)
    start = 0
    if a.load_dir:
        path, _ = engine.load_checkpoint(a.load_dir)
        assert path is not None, f"no DeepSpeed checkpoint in {a.load_dir}"
        start = engine.global_steps
    times, losses = [], []
    for step in range(start, start + a.warmup + a.steps):
        first = (step * world * mb + rank * mb) % (windows - mb)
        x = torch.from_numpy(tokens[first * (t + 1):(first + mb) * (t + 1)].reshape(mb, t + 1))
        t0 = time.perf_counter()
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    if a.save_dir:
        engine.save_checkpoint(a.save_dir)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    gathered = [None] * world
    dist.all_gather_object(gathered, dict(rss=rss, times=times, losses=losses))
    # the global batch's loss: the mean over the ranks (as train_ds.py and ds-rs report it)
    losses = [sum(g["losses"][i] for g in gathered) / world for i in range(len(losses))]
    if rank == 0:
        step_s = statistics.median(max(g["times"][i] for g in gathered) for i in range(a.warmup, len(times)))
        print(json.dumps(dict(impl="deepspeed", model=a.model, world=world, micro_batch=mb, seq_len=t,
                              zero_stage=ds_config.get("zero_optimization", {}).get("stage", 0),
                              tokens_per_s=world * mb * t / step_s, step_ms_median=1e3 * step_s,
                              losses=[round(v, 7) for v in losses],
                              peak_rss_mib_per_rank=[round(g["rss"], 1) for g in gathered])))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
