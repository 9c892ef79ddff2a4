#!/usr/bin/env python3
"""PyTorch eager's side of the Llama speed and memory rows on a GPU (issue 35): transformers'
LlamaForCausalLM of a ds-rs preset's config (random init), one process, bf16 autocast, SDPA
attention, AdamW (betas 0.9/0.95, weight decay 0.1) with fused=True where the device has it,
gradient clipping 1.0. Where this Python has no transformers (a GPU host's bare PyTorch
venv), the same architecture written here in plain PyTorch (RMSNorm, rotary, grouped-query
SDPA, SwiGLU, tied or untied head), and the JSON says which ran ("impl").

  python scripts/bench/llama_torch.py --preset llama3-1b --device cuda --micro-batch 4 --seq-len 1024

Prints one JSON line: median step time and tokens/s over the timed steps, the losses, and on a
GPU torch.cuda.max_memory_allocated / max_memory_reserved in MiB.
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

# ds-rs's presets (models/src/llama/mod.rs), as transformers' LlamaConfig fields.
PRESETS = {
    # Llama 3.2 1B's published config.json
    "llama3-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                      num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                      rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True),
    "llama-small": dict(vocab_size=8192, hidden_size=512, intermediate_size=1376,
                        num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False),
    "llama-tiny": dict(vocab_size=4096, hidden_size=256, intermediate_size=688,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False),
}


class RMSNorm(torch.nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        xf = x.float()
        n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * n.to(x.dtype)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Block(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        d, h, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
        self.h, self.kv, self.hd = h, kv, d // h
        self.ln1, self.ln2 = RMSNorm(d, c["rms_norm_eps"]), RMSNorm(d, c["rms_norm_eps"])
        self.q = torch.nn.Linear(d, d, bias=False)
        self.k = torch.nn.Linear(d, kv * self.hd, bias=False)
        self.v = torch.nn.Linear(d, kv * self.hd, bias=False)
        self.o = torch.nn.Linear(d, d, bias=False)
        f = c["intermediate_size"]
        self.gate = torch.nn.Linear(d, f, bias=False)
        self.up = torch.nn.Linear(d, f, bias=False)
        self.down = torch.nn.Linear(f, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        y = self.ln1(x)
        q = self.q(y).view(b, t, self.h, self.hd).transpose(1, 2)
        k = self.k(y).view(b, t, self.kv, self.hd).transpose(1, 2)
        v = self.v(y).view(b, t, self.kv, self.hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(self.h // self.kv, dim=1)
        v = v.repeat_interleave(self.h // self.kv, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        y = self.ln2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class PlainLlama(torch.nn.Module):
    """transformers' Llama architecture in plain PyTorch (no rope scaling)."""

    def __init__(self, c):
        super().__init__()
        self.c = c
        self.embed = torch.nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.blocks = torch.nn.ModuleList(Block(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.head = torch.nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        if c["tie_word_embeddings"]:
            self.head.weight = self.embed.weight

    def forward(self, input_ids, labels):
        t, hd = input_ids.shape[1], self.c["hidden_size"] // self.c["num_attention_heads"]
        inv = 1.0 / (self.c["rope_theta"] ** (torch.arange(0, hd, 2, device=input_ids.device).float() / hd))
        ang = torch.outer(torch.arange(t, device=input_ids.device).float(), inv)
        ang = torch.cat((ang, ang), dim=-1)
        cos, sin = ang.cos(), ang.sin()
        x = self.embed(input_ids)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def build(preset):
    c = PRESETS[preset]
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return PlainLlama(c), "torch-llama"
    model = LlamaForCausalLM(LlamaConfig(**c, attn_implementation="sdpa"))
    return model, "transformers"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-1b", choices=list(PRESETS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--plain", action="store_true", help="the plain-PyTorch Llama even where transformers is installed")
    a = ap.parse_args()
    torch.manual_seed(0)
    model, impl = (PlainLlama(PRESETS[a.preset]), "torch-llama") if a.plain else build(a.preset)
    model = model.to(a.device)
    n = sum(p.numel() for p in model.parameters())
    fused = a.device.startswith("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1, fused=fused)
    v = PRESETS[a.preset]["vocab_size"]
    gen = torch.Generator().manual_seed(1)
    cuda = a.device.startswith("cuda")
    times, losses = [], []
    for _ in range(a.warmup + a.steps):
        x = torch.randint(0, v, (a.micro_batch, a.seq_len), generator=gen).to(a.device)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=cuda):
            out = model(input_ids=x, labels=x)
            loss = out if impl == "torch-llama" else out.loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    step = statistics.median(times[a.warmup:])
    res = dict(impl=impl, preset=a.preset, params=n, device=a.device, micro_batch=a.micro_batch,
               seq_len=a.seq_len, step_ms_median=1e3 * step,
               tokens_per_s=a.micro_batch * a.seq_len / step, losses=[round(x, 5) for x in losses])
    if cuda:
        res["max_memory_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
        res["max_memory_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
    print(json.dumps(res))


if __name__ == "__main__":
    main()
