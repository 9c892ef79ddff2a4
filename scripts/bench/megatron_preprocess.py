"""Megatron-LM's tools/preprocess_data.py, JSON path only, re-created on megatron-core.

The peer environment has megatron-core (the `megatron.core` package) but not Megatron-LM's
`tools/` nor `megatron.training`, which preprocess_data.py imports for its arguments. This
script keeps that tool's structure for the case the benchmark runs (one partition, no
sentence splitting, --append-eod, a HuggingFace tokenizer) -- see Megatron-LM
tools/preprocess_data.py at NVIDIA/Megatron-LM HEAD: `Encoder.initializer` builds the
tokenizer in each pool worker, `Encoder.encode` loads one JSON line and tokenizes each
sentence of each key, appending the end-of-document token to the last non-empty one, and
`Partition.process_json_file` feeds the input file's lines through
`multiprocessing.Pool(workers, initializer=encoder.initializer).imap(encoder.encode, fin, 32)`
into one `indexed_dataset.IndexedDatasetBuilder` per key, finalized into the .idx at the end.

What differs from the original, and why it does not change the work measured:
- the tokenizer is megatron-core's HuggingFaceTokenizer (what build_tokenizer wraps for
  `--tokenizer-type HuggingFaceTokenizer`) called through `text_to_ids`, which is all that
  the wrapper's `tokenize` does (megatron/core/tokenizers/text/text_tokenizer.py);
  `use_fast=True` asks for the Rust tokenizer, as a tokenizer.json directory would get;
- no sentence splitting, partitions, --find-optimal-num-workers (unused paths left out).

Prints one JSON line: docs, chars (the sum of len(line) that the original reports as bytes),
bytes (the input file's size), startup_s (tokenizer, builders and pool, as the original's
"Time to startup"), seconds (from then to the finalized index and the joined pool),
mb_per_s (bytes / 1e6 / seconds).

    python megatron_preprocess.py --input F.jsonl --json-keys text --tokenizer DIR \
        --output-prefix P --append-eod --workers N
"""

import argparse
import json
import multiprocessing
import os
import sys
import time

from megatron.core.datasets import indexed_dataset
from megatron.core.tokenizers.text.libraries.huggingface_tokenizer import HuggingFaceTokenizer


def load_tokenizer(path):
    return HuggingFaceTokenizer(path, use_fast=True)


class Encoder:
    """One per pool worker: the tokenizer lives on the class, as in the original."""

    def __init__(self, args):
        self.args = args

    def initializer(self):
        Encoder.tokenizer = load_tokenizer(self.args.tokenizer)

    def encode(self, json_line):
        record = json.loads(json_line)
        tokenizer = Encoder.tokenizer
        ids = {}
        lens = {}
        for key in self.args.json_keys:
            text = record[key]
            sentences = text if isinstance(text, list) else [text]
            document = []
            lengths = []
            for sentence in sentences:
                sentence_ids = tokenizer.text_to_ids(sentence)
                if sentence_ids:
                    document.extend(sentence_ids)
                    lengths.append(len(sentence_ids))
            if document and self.args.append_eod:
                document.append(tokenizer.eod)
                lengths[-1] += 1
            ids[key] = document
            lens[key] = lengths
        return ids, lens, len(json_line)


def process_json_file(args):
    source = open(args.input, "r", encoding="utf-8")

    startup_start = time.time()
    encoder = Encoder(args)
    tokenizer = load_tokenizer(args.tokenizer)
    pool = multiprocessing.Pool(args.workers, initializer=encoder.initializer)
    encoded = pool.imap(encoder.encode, source, 32)

    dtype = indexed_dataset.DType.optimal_dtype(tokenizer.vocab_size)
    builders = {}
    idx_paths = {}
    for key in args.json_keys:
        stem = f"{args.output_prefix}_{key}_document"
        builders[key] = indexed_dataset.IndexedDatasetBuilder(stem + ".bin", dtype=dtype)
        idx_paths[key] = stem + ".idx"

    startup_end = time.time()
    proc_start = time.time()
    chars = 0
    docs = 0
    for docs, (doc, sentence_lens, processed) in enumerate(encoded, start=1):
        chars += processed
        for key in doc:
            builders[key].add_document(doc[key], sentence_lens[key])
        if docs % args.log_interval == 0:
            elapsed = time.time() - proc_start
            print(f"Processed {docs} documents ({docs / elapsed:.1f} docs/s, "
                  f"{chars / elapsed / 1024 / 1024:.2f} MB/s).", file=sys.stderr)

    source.close()
    for key in args.json_keys:
        builders[key].finalize(idx_paths[key])
    pool.close()
    pool.join()
    seconds = time.time() - proc_start

    size = os.path.getsize(args.input)
    print(json.dumps(dict(
        impl="megatron", docs=docs, chars=chars, bytes=size, workers=args.workers,
        startup_s=round(startup_end - startup_start, 3), seconds=round(seconds, 3),
        mb_per_s=round(size / 1e6 / seconds, 3))))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="a JSON-lines file")
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument("--tokenizer", required=True,
                        help="a directory AutoTokenizer loads (tokenizer.json, tokenizer_config.json)")
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--append-eod", action="store_true")
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--log-interval", type=int, default=1000)
    process_json_file(parser.parse_args())


if __name__ == "__main__":
    main()
