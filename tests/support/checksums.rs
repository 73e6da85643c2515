//! Checkpoints edited by tests (to make files the writer refuses: NaN or overflowing weights;
//! fuzz inputs) get their data checksums made again, so that what a load refuses them for is
//! the edit's values, not the checksums.

/// `bytes` (a checkpoint) with the CRC-32 of each block of its data (metadata
/// `checksums.block_bytes`) written into its `checksums.crc32` metadata (the header keeps its
/// length); `None` when it is not a file whose header holds them.
pub fn restamped(bytes: &[u8]) -> Option<Vec<u8>> {
    let n = usize::try_from(u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?)).ok()?;
    let header: serde_json::Value =
        serde_json::from_slice(bytes.get(8..8usize.checked_add(n)?)?).ok()?;
    let meta = header.get("__metadata__")?;
    let block: usize = meta.get("checksums.block_bytes")?.as_str()?.parse().ok()?;
    let data = &bytes[8 + n..];
    if block == 0 || meta.get("checksums.crc32")?.as_str()?.len() != 8 * data.len().div_ceil(block)
    {
        return None;
    }
    let digits: String = (data.chunks(block))
        .map(|b| format!("{:08x}", crc32fast::hash(b)))
        .collect();
    // The key's own string, after a `{` or a `,` (a key ending in it has a backslash there).
    let key = b"\"checksums.crc32\":\"";
    let (p, _) = (bytes[8..8 + n].windows(key.len()).enumerate())
        .find(|&(p, w)| w == key && p > 0 && matches!(bytes[8 + p - 1], b'{' | b','))?;
    let at = 8 + p + key.len();
    let mut out = bytes.to_vec();
    out.get_mut(at..at + digits.len())?
        .copy_from_slice(digits.as_bytes());
    Some(out)
}

/// The checkpoint at `path` [`restamped`] in place.
#[allow(dead_code)] // the fuzz tests restamp bytes
pub fn restamp_checksums(path: &std::path::Path) {
    let bytes = std::fs::read(path).unwrap();
    std::fs::write(
        path,
        restamped(&bytes).expect("a checkpoint with checksums"),
    )
    .unwrap();
}
