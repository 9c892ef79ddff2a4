//! TFRecord framing, the container of TensorBoard event files:
//! `u64 LE length | masked crc32c(length bytes) | data | masked crc32c(data)`.
//! Readers (TensorBoard's `PyRecordReader`) verify both checksums and drop the rest of the file
//! at the first mismatch, so a wrong CRC silently loses data: hence the known-value tests below.

/// The constant TensorFlow adds when masking; masking keeps a CRC stored next to the bytes it
/// covers from looking like data that was itself checksummed.
const MASK_DELTA: u32 = 0xa282_ead8;

/// TensorFlow's masked CRC32C: rotate right by 15 bits, then add the delta (mod 2^32).
pub(crate) fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(MASK_DELTA)
}

/// One framed record holding `data`.
pub(crate) fn frame(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_check_value() {
        // The CRC catalogue's check value for CRC-32C (Castagnoli).
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn crc32c_rfc3720_vectors() {
        // RFC 3720, appendix B.4: 32 bytes of zeros, of 0xff, and 0..=31.
        assert_eq!(crc32c::crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c::crc32c(&[0xffu8; 32]), 0x62A8_AB43);
        let ascending: Vec<u8> = (0u8..32).collect();
        assert_eq!(crc32c::crc32c(&ascending), 0x46DD_794E);
    }

    #[test]
    fn mask_is_rotate_then_add() {
        // 0xE3069283 rotated right by 15 = 0x2507C60D; + 0xa282ead8 = 0xC78AB0E5.
        assert_eq!(masked_crc32c(b"123456789"), 0xC78A_B0E5);
        // crc32c("") = 0, so the masked value is the delta itself.
        assert_eq!(masked_crc32c(b""), MASK_DELTA);
    }

    #[test]
    fn frame_layout() {
        let data = b"123456789";
        let f = frame(data);
        assert_eq!(f.len(), 8 + 4 + data.len() + 4);
        assert_eq!(&f[..8], &9u64.to_le_bytes());
        // Masked CRC of the 8 length bytes, as TensorBoard's own masked_crc32c computes it.
        assert_eq!(&f[8..12], &0x3971_F937u32.to_le_bytes());
        assert_eq!(&f[12..21], data);
        assert_eq!(&f[21..], &0xC78A_B0E5u32.to_le_bytes());
    }
}
