#!/usr/bin/env bash
# The flash kernels' instructions per key or query tile, read from their SASS for sm_90 (H100,
# H200), where no GPU is at hand (issue 35). A tile's loop issues its tensor-core products
# (HMMA) and everything else from the same warp schedulers; an HMMA.16816 takes about six
# cycles of a scheduler's tensor core, so a loop with more than about six other instructions
# per HMMA is bound by issue, not by the tensor cores. This counts, for each kernel at head sizes
# 64 and 128 (bf16), the instructions of one pass of its tile loop: on the tiles every row sees
# whole ("full": a causal mask's tiles below the diagonal, most of them) and on masked tiles,
# without a window. The counts are static (each instruction of the loop body once); a loop left
# inside the body is listed, since it runs more than once.
#
#   scripts/flash-instructions.sh [REV]    # REV: the same figures for flash.cu at git revision REV
#
# Needs the CUDA toolchain (scripts/install-cuda-toolchain.sh) and cuobjdump with nvdisasm
# from PyPI, installed into target/sass-tools on first use. Variants are made from copies of
# the sources in a temporary directory: the window test is set to "no window" and the kernels'
# `m.all(...)` tile test to true or false (a source without it, before the test existed, has
# one variant).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
eval "$(bash scripts/install-cuda-toolchain.sh --print-env)"
tools=$repo/target/sass-tools
if [ ! -x "$tools/bin/cuobjdump" ]; then
    python3 -m venv "$tools/venv"
    "$tools/venv/bin/pip" install --quiet --disable-pip-version-check \
        nvidia-cuda-cuobjdump==13.2.86 nvidia-cuda-nvdisasm==13.2.86
    mkdir -p "$tools/bin"
    ln -sf "$(find "$tools/venv" -path '*/bin/cuobjdump' | head -n 1)" "$tools/bin/cuobjdump"
    ln -sf "$(find "$tools/venv" -path '*/bin/nvdisasm' | head -n 1)" "$tools/bin/nvdisasm"
fi
PATH=$tools/bin:$PATH
work=$(mktemp -d "${TMPDIR:-/tmp}/flash-instructions.XXXXXX")
trap 'rm -rf "$work"' EXIT

# $1: a directory holding flash.cu and its headers; $2: its label.
count() {
    local src=$1 label=$2 variants=(one) v
    grep -q 'm\.all(' "$src/flash.cu" && variants=(full masked)
    for v in "${variants[@]}"; do
        local d=$work/$label-$v
        mkdir -p "$d"
        cp "$src"/*.cuh "$d/"
        local tile=true
        [ "$v" = masked ] && tile=false
        sed -e 's/window == 0 ||/true ||/g' -e 's/window ?/false ?/' \
            -e 's/window && /false \&\& /' -e "s/if (m\.all([^)]*))/if ($tile)/" \
            "$src/flash.cu" >"$d/flash.cu"
        nvcc -cubin -arch=sm_90 -O3 -fmad=false -Xptxas -v -o "$d/flash.cubin" "$d/flash.cu" \
            2>"$d/ptxas.txt"
        for k in fwd bwd_dkdv bwd_dq; do
            for hd in 64 128; do
                local name=flash_${k}_hd${hd}_bf16
                cuobjdump -sass -fun "$name" "$d/flash.cubin" >"$d/$name.sass"
                python3 - "$d/$name.sass" "$d/ptxas.txt" "$name" "$label $v" <<'PY'
import collections, re, sys
sass, ptxas, name, label = sys.argv[1:]
ins = []
for line in open(sass):
    m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
    if m:
        ins.append((int(m.group(1), 16), m.group(2)))
def target(text):
    m = re.search(r"BRA\s+(?:\S+\s+)?0x([0-9a-f]+)", text)
    return int(m.group(1), 16) if m else None
hmma = [a for a, t in ins if "HMMA" in t]
# the tile loop: the shortest backward branch whose span holds every product
loops = [(target(t), a) for a, t in ins
         if target(t) is not None and target(t) < a and target(t) <= hmma[0] and a >= hmma[-1]]
lo, hi = min(loops, key=lambda s: s[1] - s[0])
body = [t for a, t in ins if lo <= a <= hi]
op = lambda t: re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
ops = collections.Counter(op(t) for t in body)
inner = [(target(t), a) for a, t in ins
         if lo < a < hi and target(t) is not None and lo < target(t) < a]
regs = spills = "?"
current = None
for line in open(ptxas):
    m = re.search(r"Compiling entry function '(\w+)'", line)
    current = m.group(1) if m else current
    if current == name:
        m = re.search(r"Used (\d+) registers", line)
        regs = m.group(1) if m else regs
        m = re.search(r"(\d+) bytes spill stores", line)
        spills = m.group(1) if m else spills
other = len(body) - ops["HMMA"]
note = "".join(f"; an inner loop of {sum(1 for a, _ in ins if s <= a <= e)}" for s, e in inner)
print(f"{name:26} {label:14} {len(body):5} a tile: HMMA {ops['HMMA']:3}, MUFU {ops['MUFU']:3}, "
      f"LDSM {ops['LDSM']:3}, other {other - ops['MUFU'] - ops['LDSM']:4} "
      f"({other / ops['HMMA']:.1f} others per HMMA); {regs} registers, {spills} bytes "
      f"spilled{note}")
PY
            done
        done
    done
}

count "$repo/nn/kernels" "tree"
if [ $# -gt 0 ]; then
    mkdir -p "$work/rev"
    # the kernels lived in engine/kernels before the model layer (nn/) was its own crate
    kernels=nn/kernels
    git cat-file -e "$1:$kernels" 2>/dev/null || kernels=engine/kernels
    git archive "$1" "$kernels" | tar -x -C "$work/rev"
    count "$work/rev/$kernels" "$1"
fi
