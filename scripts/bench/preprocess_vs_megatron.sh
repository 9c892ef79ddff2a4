#!/usr/bin/env bash
# `ds-rs data preprocess` against Megatron-LM's tools/preprocess_data.py (re-created on
# megatron-core by megatron_preprocess.py: the peer environment lacks Megatron-LM's tools/), in
# one run, on the same corpus, tokenizer and worker count:
# - a JSON-lines corpus of about MB megabytes of the real text this machine ships
#   (/usr/share/common-licenses/*, the GNU manuals /usr/share/info/*.gz), its paragraphs grouped
#   into numbered documents (every 8th one a list of paragraphs, Megatron's "sentences");
# - a byte-level BPE tokenizer (vocabulary 32000, "<|endoftext|>" its EOS) trained on that text;
# - both programs with --append-eod and WORKERS workers, each command's wall time (startup
#   included) and each one's own figure (after its startup);
# - the two .bin and the two .idx files must be byte-identical (exit 1 otherwise).
# Prints one JSON line per program and a table with the ratio ds-rs / Megatron of MB/s.
#
#   scripts/bench/preprocess_vs_megatron.sh [WORKERS] [MB]
#
# Needs the peer environment of ../shared/bench/setup.sh (/opt/peer: megatron-core,
# transformers, tokenizers) and a release build.
set -euo pipefail
workers=${1:-2}
mb=${2:-64}
root=$(cd "$(dirname "$0")/../.." && pwd)
peer=${PEER_PYTHON:-/opt/peer/bin/python}
dsrs=$root/target/release/ds-rs
work=$(mktemp -d /tmp/preprocess_vs_megatron.XXXXXX)
trap 'rm -rf "$work"' EXIT
export PATH="$(dirname "$peer"):$PATH"
# megatron-core warns, on import, that Transformer Engine and Apex are absent
export PYTHONWARNINGS=ignore::UserWarning
now() { date +%s.%N; }

# the corpus, and the text the tokenizer learns from (each paragraph once)
"$peer" - "$work" "$mb" <<'PY'
import glob, gzip, json, os, re, sys

work, mb = sys.argv[1], float(sys.argv[2])
texts, seen = [], set()
for path in sorted(glob.glob("/usr/share/common-licenses/*")) + sorted(glob.glob("/usr/share/info/*.gz")):
    real = os.path.realpath(path)
    if real in seen or not os.path.isfile(real):
        continue
    seen.add(real)
    try:
        raw = gzip.open(real).read() if real.endswith(".gz") else open(real, "rb").read()
    except OSError:
        continue
    texts.append(raw.decode("utf-8", errors="replace"))
paragraphs = [p.strip("\n") for t in texts for p in re.split(r"\n\s*\n", t) if p.strip()]
if not paragraphs:
    sys.exit("no text under /usr/share/common-licenses nor /usr/share/info")
with open(os.path.join(work, "train.txt"), "w", encoding="utf-8") as f:
    f.write("\n\n".join(paragraphs))
target = int(mb * 1e6)
written, n, at = 0, 0, 0
with open(os.path.join(work, "corpus.jsonl"), "w", encoding="utf-8") as f:
    while written < target:
        k = 2 + n * 7 % 11  # 2 to 12 paragraphs
        parts = [f"Document {n}"] + [paragraphs[(at + i) % len(paragraphs)] for i in range(k)]
        at = (at + k) % len(paragraphs)
        text = parts if n % 8 == 7 else "\n\n".join(parts)
        line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
        f.write(line)
        written += len(line.encode("utf-8"))
        n += 1
print(f"corpus: {n} documents, {written / 1e6:.1f} MB from {len(paragraphs)} paragraphs "
      f"of {len(texts)} files", file=sys.stderr)
PY

"$peer" - "$work" <<'PY'
import json, os, sys
from tokenizers import ByteLevelBPETokenizer

work = sys.argv[1]
out = os.path.join(work, "tokenizer")
os.makedirs(out)
bpe = ByteLevelBPETokenizer()
bpe.train([os.path.join(work, "train.txt")], vocab_size=32000, min_frequency=2,
          special_tokens=["<|endoftext|>"], show_progress=False)
bpe.save(os.path.join(out, "tokenizer.json"))
with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}, f)
# Megatron's wrapper must load it and agree with the Rust tokenizer
from megatron.core.tokenizers.text.libraries.huggingface_tokenizer import HuggingFaceTokenizer
hf = HuggingFaceTokenizer(out, use_fast=True)
sample = "Document 0\n\nThe GNU General Public License  is a free, copyleft license.\n"
assert hf.text_to_ids(sample) == bpe.encode(sample).ids, "transformers and tokenizers disagree"
print(f"tokenizer: vocabulary {hf.vocab_size}, eod {hf.eod}", file=sys.stderr)
PY

corpus=$work/corpus.jsonl
bytes=$(stat -c %s "$corpus")

t0=$(now)
mg=$("$peer" "$root/scripts/bench/megatron_preprocess.py" --input "$corpus" --json-keys text \
    --tokenizer "$work/tokenizer" --output-prefix "$work/megatron" --append-eod \
    --workers "$workers" | grep '^{')
t1=$(now)
rs_out=$("$dsrs" data preprocess --input "$corpus" --json-keys text --tokenizer "$work/tokenizer" \
    --output-prefix "$work/dsrs" --append-eod --workers "$workers")
t2=$(now)
echo "$rs_out" >&2

python3 - "$bytes" "$workers" "$t0" "$t1" "$t2" "$mg" "$rs_out" <<'PY'
import json, re, sys

size, workers = int(sys.argv[1]), int(sys.argv[2])
t0, t1, t2 = map(float, sys.argv[3:6])
mg = json.loads(sys.argv[6])
m = re.search(r"preprocessed (\d+) documents, [\d.]+ MB in ([\d.]+) s", sys.argv[7])
rs = dict(impl="ds-rs", docs=int(m.group(1)), bytes=size, workers=workers,
          seconds=float(m.group(2)), mb_per_s=round(size / 1e6 / float(m.group(2)), 3))
mg["wall_s"], rs["wall_s"] = round(t1 - t0, 3), round(t2 - t1, 3)
for r in (mg, rs):
    r["wall_mb_per_s"] = round(size / 1e6 / r["wall_s"], 3)
    print(json.dumps(r))
print(f"\n{size / 1e6:.1f} MB, {mg['docs']} documents, {workers} workers (MB = 1e6 bytes of JSON lines)")
print(f"{'':10} {'wall s':>8} {'wall MB/s':>10} {'own s':>8} {'own MB/s':>9}")
for r in (mg, rs):
    print(f"{r['impl']:10} {r['wall_s']:8.2f} {r['wall_mb_per_s']:10.2f} {r['seconds']:8.2f} {r['mb_per_s']:9.2f}")
print(f"{'ratio':10} {'':8} {rs['wall_mb_per_s'] / mg['wall_mb_per_s']:10.2f} {'':8} "
      f"{rs['mb_per_s'] / mg['mb_per_s']:9.2f}   (ds-rs / Megatron)")
if rs["docs"] != mg["docs"]:
    sys.exit(f"document counts differ: ds-rs {rs['docs']}, Megatron {mg['docs']}")
PY

same=0
for ext in bin idx; do
    if cmp "$work/megatron_text_document.$ext" "$work/dsrs_text_document.$ext"; then
        echo "$ext: identical ($(stat -c %s "$work/dsrs_text_document.$ext") bytes)"
    else
        same=1
    fi
done
exit $same
