"""Write CSV files the way DeepSpeed's csvMonitor.write_events does, as a byte-level reference.

Usage: csv_reference.py OUT_DIR < batches.json
batches.json: a list of write_events calls, each a list of [tag, value, step].

Follows deepspeed/monitor/csv_monitor.py: file OUT_DIR/<tag with '/' and ' ' -> '_'>.csv, opened
in append mode per event, a ['step', <last '/' segment of tag>] header the first time this
process writes that file, then [step, value] through Python's csv.writer defaults.
"""

import csv
import json
import os
import sys


def write_batches(out_dir, batches):
    started = set()
    for batch in batches:
        for tag, value, step in batch:
            stem = tag.replace("/", "_").replace(" ", "_")
            with open(os.path.join(out_dir, stem + ".csv"), "a+") as f:
                writer = csv.writer(f)
                if stem not in started:
                    started.add(stem)
                    writer.writerow(["step", tag.split("/")[-1]])
                writer.writerow([step, float(value)])


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: csv_reference.py OUT_DIR < batches.json")
    os.makedirs(sys.argv[1], exist_ok=True)
    write_batches(sys.argv[1], json.load(sys.stdin))
