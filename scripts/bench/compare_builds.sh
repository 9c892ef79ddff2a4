#!/usr/bin/env bash
# Two ds-rs builds' training speed, interleaved in one run, so a refactor's cost is read on the
# same machine at the same moment: `ds-rs bench train` (the peer benchmark's model, data and
# configs, 2 ranks) for each model and ZeRO stage, build A then build B, ROUNDS times, and the
# median tokens/s of each with the ratio B/A.
#
#   scripts/bench/compare_builds.sh A_BIN B_BIN [ROUNDS]   # e.g. a copy of the old build, target/release/ds-rs
#
# MODELS (default "tiny small") and STAGES (default "1 3") choose the cells. The ZeRO-3 config
# is the peer's zero1.json at stage 3.
set -euo pipefail
a=$1 b=$2 rounds=${3:-3}
here="$(cd "$(dirname "$0")/../.." && pwd)"
peer="$here/scripts/bench/peer/configs"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for stage in 0 1 2 3; do
    sed "s/\"stage\": 1/\"stage\": $stage/" "$peer/zero1.json" >"$work/zero$stage.json"
done
tokens() { # BIN MODEL STAGE -> tokens/s
    "$1" bench train --model "$2" --config "$work/zero$3.json" --nproc 2 --json 2>/dev/null |
        python3 -c 'import json,sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])["tokens_per_s"])'
}
median() { python3 -c 'import statistics,sys; print(statistics.median(float(x) for x in sys.argv[1:]))' "$@"; }
printf "%-6s %-5s %12s %12s %7s\n" model stage "A tok/s" "B tok/s" "B/A"
for model in ${MODELS:-tiny small}; do
    for stage in ${STAGES:-1 3}; do
        ra=() rb=()
        for _ in $(seq "$rounds"); do
            ra+=("$(tokens "$a" "$model" "$stage")")
            rb+=("$(tokens "$b" "$model" "$stage")")
        done
        echo "$model zero-$stage rounds: A ${ra[*]} | B ${rb[*]}" >&2
        ma=$(median "${ra[@]}") mb=$(median "${rb[@]}")
        printf "%-6s %-5s %12.0f %12.0f %7.3f\n" "$model" "$stage" "$ma" "$mb" \
            "$(python3 -c "print($mb / $ma)")"
    done
done
