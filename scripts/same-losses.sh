#!/usr/bin/env bash
# The redesign's "same numbers" check: the losses of `ds-rs train` over 20 steps at fixed seeds,
# in every layout the check names, written one file a layout, so that two builds (before and
# after a refactor) compare bit for bit:
#
#   scripts/same-losses.sh run BIN DIR     # BIN: a ds-rs binary; DIR: where the losses go
#   scripts/same-losses.sh compare A B     # exit 1 naming every layout whose losses differ
#
# Each file holds the step losses and the final eval loss exactly as metrics.jsonl printed
# them (shortest round-trip decimal of the f64, so equal text is equal bits).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
examples="$here/configs/examples"

# name | ranks | train arguments (after --config)
cases() {
    cat <<EOF
gpt-dp1|1|$examples/zero0.json train --model tiny
gpt-dp2-z1|2|$examples/zero1.json train --model tiny
gpt-dp2-z2|2|$examples/zero2.json train --model tiny
gpt-dp2-z3|2|$examples/zero3.json train --model tiny
gpt-tp2|2|$examples/zero1.json train --model tiny --tp 2
gpt-pp2|2|$examples/pipeline.json train --model tiny --pp 2
mixtral-ep2|2|$examples/zero1.json train --model mixtral-tiny --ep 2
llama-dp2-z3|2|$examples/zero3.json train --model llama-tiny
qwen2-tp2|2|$examples/zero1.json train --model qwen2-tiny --tp 2
gpt-tile|1|$examples/zero0.json train --model tiny --tile 24
llama-tile-z2|2|$examples/zero2.json train --model llama-tiny --tile 24
gpt-moe-ep2|2|$examples/zero1.json train --model gpt-moe-tiny --ep 2
qwen3-moe-tp2|2|$examples/zero1.json train --model qwen3-moe-tiny --tp 2
gpt-sp2|2|$examples/zero1.json train --model tiny --sp 2
llama-sp2|2|$examples/zero2.json train --model llama-tiny --sp 2
mistral-window|1|$examples/zero0.json train --model mistral-tiny --seq-len 96
llama-flash|1|$examples/zero0.json train --model llama-tiny --seq-len 1024
EOF
}

run() {
    local bin="$1" out="$2"
    mkdir -p "$out"
    local work
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' RETURN
    while IFS='|' read -r name ranks rest; do
        read -r -a words <<<"$rest"
        local config="${words[0]}"
        local program=("${words[@]:1}")
        # 64 positions unless the case says otherwise (a window or the blockwise attention)
        [[ " ${program[*]} " == *" --seq-len "* ]] || program+=(--seq-len 64)
        "$bin" launch --nproc_per_node "$ranks" --config "$config" "${program[@]}" \
            --steps 20 --seed 1234 --eval-interval 0 --eval-batches 1 \
            --metrics-dir "$work/$name" >"$work/$name.log" 2>&1 ||
            { echo "$name: failed"; tail -5 "$work/$name.log"; exit 1; }
        grep -o '"\(loss\|eval_loss\)":[^,}]*' "$work/$name/metrics.jsonl" >"$out/$name.txt"
        echo "$name: $(wc -l <"$out/$name.txt") losses"
    done < <(cases)
}

compare() {
    local a="$1" b="$2" bad=0
    while IFS='|' read -r name _; do
        if cmp -s "$a/$name.txt" "$b/$name.txt"; then
            echo "$name: same bits"
        else
            echo "$name: DIFFERENT"
            diff "$a/$name.txt" "$b/$name.txt" | head -4
            bad=1
        fi
    done < <(cases)
    return "$bad"
}

case "${1:-}" in
run) run "$2" "$3" ;;
compare) compare "$2" "$3" ;;
*)
    sed -n '2,10p' "$0"
    exit 2
    ;;
esac
