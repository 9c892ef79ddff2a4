//! Hand-encoded `tensorboard.Event` protobufs (tensorboard/compat/proto/event.proto,
//! summary.proto). Only the fields DeepSpeed's scalars need; a protobuf crate plus generated
//! code would be far heavier than these few lines.
//!
//! ```text
//! Event   { double wall_time = 1; int64 step = 2; string file_version = 3;
//!           Summary summary = 5; SourceMetadata source_metadata = 10; }
//! Summary { repeated Value value = 1; }
//! Value   { string tag = 1; float simple_value = 2; }
//! SourceMetadata { string writer = 1; }
//! ```
//!
//! Fields are written in field-number order and proto3 defaults (0 step, 0.0 wall time) are
//! left out, as Python's protobuf does, so the bytes are canonical and re-serialize unchanged.

const WIRE_VARINT: u32 = 0;
const WIRE_FIXED64: u32 = 1;
const WIRE_LEN: u32 = 2;
const WIRE_FIXED32: u32 = 5;

/// The version string every TensorBoard reader expects in the first record of a file.
pub(crate) const FILE_VERSION: &str = "brain.Event:2";

/// The first record of an event file: wall time, file version and who wrote it.
pub(crate) fn file_version_event(wall_time: f64, writer: &str) -> Vec<u8> {
    let mut out = Vec::new();
    put_double(&mut out, 1, wall_time);
    put_bytes(&mut out, 3, FILE_VERSION.as_bytes());
    let mut source = Vec::new();
    put_bytes(&mut source, 1, writer.as_bytes());
    put_bytes(&mut out, 10, &source);
    out
}

/// One scalar, as torch's `SummaryWriter.add_scalar` writes it: one Event holding a Summary
/// with a single `simple_value` (a 32-bit float on disk).
pub(crate) fn scalar_event(wall_time: f64, step: u64, tag: &str, value: f32) -> Vec<u8> {
    let mut value_msg = Vec::new();
    put_bytes(&mut value_msg, 1, tag.as_bytes());
    put_key(&mut value_msg, 2, WIRE_FIXED32);
    value_msg.extend_from_slice(&value.to_le_bytes());
    let mut summary = Vec::new();
    put_bytes(&mut summary, 1, &value_msg);
    let mut out = Vec::new();
    put_double(&mut out, 1, wall_time);
    if step != 0 {
        // int64 on the wire; a u64 step up to i64::MAX has the same varint.
        put_key(&mut out, 2, WIRE_VARINT);
        put_varint(&mut out, step);
    }
    put_bytes(&mut out, 5, &summary);
    out
}

/// Base-128 varint, least significant group first, high bit set on all but the last byte.
fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_key(out: &mut Vec<u8>, field: u32, wire: u32) {
    put_varint(out, u64::from(field << 3 | wire));
}

/// A length-delimited field (string, bytes or nested message).
fn put_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_key(out, field, WIRE_LEN);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// A double field; proto3 leaves out the default (+0.0).
fn put_double(out: &mut Vec<u8>, field: u32, v: f64) {
    if v.to_bits() != 0 {
        put_key(out, field, WIRE_FIXED64);
        out.extend_from_slice(&v.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn varint(v: u64) -> Vec<u8> {
        let mut out = Vec::new();
        put_varint(&mut out, v);
        out
    }

    #[test]
    fn varints_from_the_protobuf_encoding_guide() {
        assert_eq!(varint(0), [0x00]);
        assert_eq!(varint(1), [0x01]);
        assert_eq!(varint(127), [0x7f]);
        assert_eq!(varint(150), [0x96, 0x01]);
        assert_eq!(varint(300), [0xac, 0x02]);
        assert_eq!(varint(16_384), [0x80, 0x80, 0x01]);
        let mut max = vec![0xff; 9];
        max.push(0x01);
        assert_eq!(varint(u64::MAX), max);
    }

    #[test]
    fn scalar_event_bytes() {
        // Derived by hand: 0x09 = field 1 fixed64; 1.5 = 0x3FF8000000000000 LE.
        // 0x10 = field 2 varint; 300 = ac 02. 0x2a = field 5 len 0x0a:
        //   0x0a len 0x08 (Value): 0x0a 0x01 'a' (tag), 0x15 (field 2 fixed32) + 0.25f32 LE.
        let expected = [
            0x09, 0, 0, 0, 0, 0, 0, 0xf8, 0x3f, // wall_time
            0x10, 0xac, 0x02, // step
            0x2a, 0x0a, 0x0a, 0x08, 0x0a, 0x01, b'a', 0x15, 0, 0, 0x80, 0x3e, // summary
        ];
        assert_eq!(scalar_event(1.5, 300, "a", 0.25), expected);
    }

    #[test]
    fn zero_step_and_zero_value() {
        // Step 0 is the proto3 default and is left out; simple_value sits in a oneof, so 0.0 is
        // still written.
        let expected = [
            0x09, 0, 0, 0, 0, 0, 0, 0xf8, 0x3f, // wall_time
            0x2a, 0x0a, 0x0a, 0x08, 0x0a, 0x01, b'a', 0x15, 0, 0, 0, 0, // summary
        ];
        assert_eq!(scalar_event(1.5, 0, "a", 0.0), expected);
    }

    #[test]
    fn file_version_event_bytes() {
        let mut expected = vec![0x09, 0, 0, 0, 0, 0, 0, 0xf0, 0x3f]; // wall_time 1.0
        expected.extend_from_slice(&[0x1a, 13]); // field 3, 13 bytes
        expected.extend_from_slice(b"brain.Event:2");
        expected.extend_from_slice(&[0x52, 4, 0x0a, 2]); // field 10 { field 1, 2 bytes }
        expected.extend_from_slice(b"ds");
        assert_eq!(file_version_event(1.0, "ds"), expected);
    }

    #[test]
    fn long_tag_uses_multi_byte_length() {
        let tag = "t".repeat(200);
        let ev = scalar_event(1.0, 1, &tag, 1.0);
        // Value: 0x0a c8 01 (tag, 200 bytes) + 200 + 0x15 + 4 bytes = 208 bytes.
        // Summary: 0x0a d0 01 (value, 208 bytes) + 208 = 211 bytes; Event: 0x2a d3 01.
        let summary_at = 9 + 2; // wall_time, step key + 1-byte varint
        assert_eq!(&ev[summary_at..summary_at + 3], &[0x2a, 0xd3, 0x01]);
        assert_eq!(&ev[summary_at + 3..summary_at + 6], &[0x0a, 0xd0, 0x01]);
        assert_eq!(&ev[summary_at + 6..summary_at + 9], &[0x0a, 0xc8, 0x01]);
        assert_eq!(ev.len(), summary_at + 3 + 211);
    }
}
