//! Checkpoints edited in place by tests (to make files the writer refuses: NaN or overflowing
//! weights) get their data checksums made again, so that what a load refuses them for is the
//! edit's values, not the checksums.

/// Recomputes the CRC-32 of each block of the data of the checkpoint at `path` (metadata
/// `checksums.block_bytes`) into its `checksums.crc32` metadata, in place (the header keeps
/// its length).
pub fn restamp_checksums(path: &std::path::Path) {
    let mut bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let block: usize = header["__metadata__"]["checksums.block_bytes"]
        .as_str()
        .expect("a checkpoint with checksums")
        .parse()
        .unwrap();
    let digits: String = (bytes[8 + n..].chunks(block))
        .map(|b| format!("{:08x}", crc32fast::hash(b)))
        .collect();
    let key = b"\"checksums.crc32\":\"";
    let at = 8
        + (bytes[8..8 + n].windows(key.len()))
            .position(|w| w == key)
            .expect("the checksums' key")
        + key.len();
    bytes[at..at + digits.len()].copy_from_slice(digits.as_bytes());
    std::fs::write(path, &bytes).unwrap();
}
