//! Row records (weights, then optimizer state) moved between the FP32 rows of device tables and
//! the host in one packed transfer each way (`kernels/tbe_cache.cu`): the data path of a GPU
//! cache whose rows live in host memory.

use super::{DeviceTables, Weights};
use crate::args;
use crate::cuda::{DeviceBuffer, LaunchConfig};
use crate::error::{Error, Result};

crate::kernel_source!(
    pub(crate) static CACHE = "tbe_cache.cu",
    ["cache_records_take", "cache_records_put"];
);

/// Warps per block of the record kernels.
const WARPS: u32 = 8;

/// Where one record's parts sit in the device buffers (element offsets and lengths).
#[derive(Clone, Copy, Debug)]
pub(crate) struct RecordAt {
    pub weights: (usize, usize),
    pub state: [(usize, usize); 2],
}

impl RecordAt {
    /// Floats of the record.
    pub(crate) fn len(&self) -> usize {
        self.weights.1 + self.state[0].1 + self.state[1].1
    }
}

impl DeviceTables {
    /// The kernel's `at` array for `records` (packed back to back) and the packed length;
    /// every part checked to lie inside its buffer.
    fn record_offsets(&self, records: &[RecordAt]) -> Result<(Vec<i64>, usize)> {
        let Weights::F32(w) = &self.weights else {
            return Err(Error::invalid(
                "cached TBE",
                "the device tables hold quantized rows, not FP32 records",
            ));
        };
        let lens = [
            w.len(),
            self.state.first().map_or(0, DeviceBuffer::len),
            self.state.get(1).map_or(0, DeviceBuffer::len),
        ];
        let mut at = Vec::with_capacity(records.len() * 7);
        let mut packed = 0usize;
        for r in records {
            at.push(packed as i64);
            for (k, (start, len)) in [r.weights, r.state[0], r.state[1]].into_iter().enumerate() {
                if len > 0 && start + len > lens[k] {
                    return Err(Error::invalid(
                        "cached TBE",
                        format!(
                            "record part {k} at {start}..{} is outside its buffer of {} \
                             (internal)",
                            start + len,
                            lens[k]
                        ),
                    ));
                }
                at.extend([start as i64, len as i64]);
            }
            packed += r.len();
        }
        Ok((at, packed))
    }

    /// The weights and state buffers as the record kernels take them (a missing state buffer
    /// is never read: its lengths are 0).
    fn record_buffers(&self) -> [&DeviceBuffer<f32>; 3] {
        let Weights::F32(w) = &self.weights else {
            unreachable!("checked by record_offsets");
        };
        [
            w,
            self.state.first().unwrap_or(w),
            self.state.get(1).unwrap_or(w),
        ]
    }

    /// The records `records`, packed back to back, copied to the host.
    pub(crate) fn take_records(&self, records: &[RecordAt]) -> Result<Vec<f32>> {
        let (at, packed) = self.record_offsets(records)?;
        if packed == 0 {
            return Ok(Vec::new());
        }
        let dev = &self.device;
        let d_at = dev.htod(&at)?;
        let out = dev.alloc::<f32>(packed)?;
        let [w, s0, s1] = self.record_buffers();
        // Every part lies inside its buffer (record_offsets) and `out` holds them all.
        dev.launch(
            CACHE.kernel("cache_records_take"),
            LaunchConfig::warp_per_item(records.len(), WARPS),
            &args![*w, *s0, *s1, d_at, records.len() as i64, out],
        )?;
        out.to_host()
    }

    /// Writes `packed` (records back to back, as [`take_records`](Self::take_records) gives
    /// them) into the rows of `records`.
    pub(crate) fn put_records(&self, records: &[RecordAt], packed: &[f32]) -> Result<()> {
        let (at, len) = self.record_offsets(records)?;
        if len != packed.len() {
            return Err(Error::invalid(
                "cached TBE",
                format!(
                    "{} packed values for records of {len} (internal)",
                    packed.len()
                ),
            ));
        }
        if len == 0 {
            return Ok(());
        }
        let dev = &self.device;
        let d_at = dev.htod(&at)?;
        let d_packed = dev.htod(packed)?;
        let [w, s0, s1] = self.record_buffers();
        // As in take_records: every part inside its buffer, `d_packed` holds them all.
        dev.launch(
            CACHE.kernel("cache_records_put"),
            LaunchConfig::warp_per_item(records.len(), WARPS),
            &args![*w, *s0, *s1, d_at, records.len() as i64, d_packed],
        )
    }
}
