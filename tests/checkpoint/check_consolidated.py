"""Independent check of `ds-rs checkpoint consolidate`, with Python's safetensors and numpy.

usage: check_consolidated.py CONSOLIDATED GATHERED MODEL_JSON

The consolidated file must hold exactly the parameters of the peer benchmark's GPT
(../shared/bench/gpt.py naming) for MODEL_JSON's sizes, as float32 with the right shapes, and
their values must equal GATHERED (the parameters the running job gathered in memory).
Prints "ok" and exits 0, or prints the first difference and exits 1.
"""
import json
import sys

import numpy as np
from safetensors.numpy import load_file


def gpt_shapes(c):
    V, T, d, L = c["V"], c["T"], c["d"], c["L"]
    shapes = {"wte.weight": (V, d), "wpe.weight": (T, d)}
    for i in range(L):
        p = f"h.{i}."
        shapes.update({
            p + "ln_1.weight": (d,), p + "ln_1.bias": (d,),
            p + "attn.c_attn.weight": (3 * d, d), p + "attn.c_attn.bias": (3 * d,),
            p + "attn.c_proj.weight": (d, d), p + "attn.c_proj.bias": (d,),
            p + "ln_2.weight": (d,), p + "ln_2.bias": (d,),
            p + "mlp.c_fc.weight": (4 * d, d), p + "mlp.c_fc.bias": (4 * d,),
            p + "mlp.c_proj.weight": (d, 4 * d), p + "mlp.c_proj.bias": (d,),
        })
    shapes.update({"ln_f.weight": (d,), "ln_f.bias": (d,), "lm_head.weight": (V, d)})
    return shapes


def main():
    consolidated, gathered = load_file(sys.argv[1]), load_file(sys.argv[2])
    with open(sys.argv[3]) as f:
        want = gpt_shapes(json.load(f))
    if set(consolidated) != set(want):
        print("names differ:", sorted(set(consolidated) ^ set(want)))
        return 1
    for name, shape in want.items():
        t = consolidated[name]
        if t.dtype != np.float32 or t.shape != shape:
            print(f"{name}: {t.dtype} {t.shape}, expected float32 {shape}")
            return 1
        if not np.array_equal(t, gathered[name]):
            diff = np.abs(t - gathered[name]).max()
            print(f"{name}: differs from the gathered parameters by up to {diff}")
            return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
