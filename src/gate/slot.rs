//! Redis Cluster hash slots, to group a batch by slot.

/// CRC16/XMODEM, as Redis Cluster uses it.
fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in bytes {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The hash tag of `key`: the part between its first `{` and the next `}`, when not empty.
#[inline]
fn hash_tag(key: &[u8]) -> Option<&[u8]> {
    let open = key.iter().position(|&b| b == b'{')?;
    let rest = &key[open + 1..];
    let close = rest.iter().position(|&b| b == b'}')?;
    (close > 0).then(|| &rest[..close])
}

/// The hash slot of `key`: CRC16 of the key, or of its hash tag (see [`hash_tag`]), modulo
/// 16384.
pub(crate) fn slot(key: &[u8]) -> u16 {
    crc16(hash_tag(key).unwrap_or(key)) % 16_384
}

/// The hash slot of every key that begins with `head`, when `head` alone decides it: it
/// holds a whole hash tag (its first `{`, then a `}` after at least one byte). `None` when
/// what follows `head` can change the slot (no tag, an empty `{}`, a tag left open).
pub(crate) fn fixed_slot(head: &[u8]) -> Option<u16> {
    hash_tag(head).map(|tag| crc16(tag) % 16_384)
}

#[cfg(test)]
mod tests {
    use super::{fixed_slot, slot};

    #[test]
    fn a_fixed_slot_is_the_slot_of_every_key_after_the_head() {
        for head in ["{rl}", "app:{t-1}:per-ip:", "{a}{b}"] {
            let fixed = fixed_slot(head.as_bytes()).unwrap();
            for rest in ["", "x", "}", "{other}", "10.0.0.1"] {
                assert_eq!(
                    slot(format!("{head}{rest}").as_bytes()),
                    fixed,
                    "{head}{rest}"
                );
            }
        }
        for head in ["", "flowgate:per-ip:", "{}", "{open", "x{}y{z}"] {
            assert_eq!(fixed_slot(head.as_bytes()), None, "{head}");
        }
    }

    #[test]
    fn known_slots() {
        // Values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(slot(b"123456789"), 0x31C3);
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(slot(b"{user1000}.following"), slot(b"user1000"));
        assert_eq!(slot(b"{}.x"), slot(b"{}.x"));
        assert_ne!(slot(b"{}.x"), slot(b"x"));
    }
}
