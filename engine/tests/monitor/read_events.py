"""Read one TensorBoard event file with TensorBoard's own readers and print it as JSON.

Usage: read_events.py EVENT_FILE

Output: {"file_version", "records", "canonical",
         "events": [{tag, step, value, bits, wall_time}], "accumulator": [{tag, step, value, bits}]}
(value: repr() text, so nan and inf survive JSON; bits: the stored float32's bit pattern, so a
comparison need not trust decimal parsing.)

- records/canonical: every TFRecord read strictly (a CRC mismatch raises and the script exits
  non-zero), parsed as tensorboard.Event; canonical says re-serializing each parsed Event gives
  back the exact bytes on disk.
- events: scalars in file order from EventFileLoader, the loader TensorBoard's backend uses
  (it applies TensorBoard's compat migration, turning simple_value into a scalar tensor).
- accumulator: EventAccumulator.Scalars(tag) for every scalar tag, what the UI plots.
"""

import json
import struct
import sys

from tensorboard.backend.event_processing import event_accumulator, event_file_loader
from tensorboard.compat.proto import event_pb2
from tensorboard.util import tensor_util


def strict_records(path):
    # EventFileLoader.Load() treats a CRC error as a truncated write and stops quietly, which
    # would hide a framing bug; the record iterator underneath raises DataLossError instead.
    return list(event_file_loader._make_tf_record_iterator(path))


def scalar_of(value):
    if value.HasField("tensor"):
        return float(tensor_util.make_ndarray(value.tensor).item())
    return float(value.simple_value)


def f32_bits(x):
    # The stored float32's bit pattern: exact, unlike a decimal float parsed back elsewhere.
    return struct.unpack("<I", struct.pack("<f", x))[0]


def loader_events(path):
    out = []
    for event in event_file_loader.EventFileLoader(path).Load():
        for value in event.summary.value:
            x = scalar_of(value)
            out.append({
                "tag": value.tag,
                "step": event.step,
                "value": repr(x),
                "bits": f32_bits(x),
                "wall_time": event.wall_time,
            })
    return out


def accumulator_scalars(path):
    acc = event_accumulator.EventAccumulator(
        path, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    out = []
    for tag in sorted(acc.Tags()["scalars"]):
        for s in acc.Scalars(tag):
            out.append({"tag": tag, "step": s.step, "value": repr(s.value), "bits": f32_bits(s.value)})
    return out


def main(path):
    raw = strict_records(path)
    parsed = [event_pb2.Event.FromString(r) for r in raw]
    print(json.dumps({
        "file_version": parsed[0].file_version if parsed else None,
        "records": len(raw),
        "canonical": all(e.SerializeToString() == r for e, r in zip(parsed, raw)),
        "events": loader_events(path),
        "accumulator": accumulator_scalars(path),
    }))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: read_events.py EVENT_FILE")
    main(sys.argv[1])
