//! Row records (weights, then optimizer state) moved between the FP32 rows of device tables and
//! the host in one packed transfer each way (`kernels/tbe_cache.cu`): the data path of a GPU
//! cache whose rows live in host memory.

use std::sync::Arc;

use super::{DeviceTables, Weights};
use crate::args;
use crate::cuda::{CudaDevice, DeviceBuffer, DeviceElem, LaunchConfig, PinnedBuffer};
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

/// A pinned host buffer and a device buffer of the same room, grown as needed: values cross
/// between them in asynchronous copies at the copy engines' speed (pageable copies are staged
/// by the driver, several times slower).
pub(crate) struct Staging<T: DeviceElem> {
    pinned: PinnedBuffer<T>,
    device: DeviceBuffer<T>,
}

/// `slot`'s staging, grown (to a power of two) to hold `len` values.
fn room<'a, T: DeviceElem>(
    slot: &'a mut Option<Staging<T>>,
    device: &Arc<CudaDevice>,
    len: usize,
) -> Result<&'a mut Staging<T>> {
    if slot.as_ref().is_none_or(|s| s.device.len() < len) {
        // The old buffers go first: both may be large.
        *slot = None;
        let cap = len.max(1).next_power_of_two();
        *slot = Some(Staging {
            pinned: device.pinned(cap)?,
            device: device.alloc(cap)?,
        });
    }
    let s = slot.as_mut().expect("made above");
    // Admissions run on the caller's stream or a cache's prefetch stream: the memory waits
    // for both when freed.
    s.device.note_stream(device.current_stream_id());
    Ok(s)
}

/// The staging buffers of a GPU cache's record moves: the offsets, records coming down and
/// records going up.
#[derive(Default)]
pub(crate) struct RecordStaging {
    pub at: Option<Staging<i64>>,
    pub down: Option<Staging<f32>>,
    pub up: Option<Staging<f32>>,
}

impl DeviceTables {
    /// `at` on the device, through the pinned `staging`.
    fn stage_at<'s>(
        &self,
        at: &[i64],
        staging: &'s mut Option<Staging<i64>>,
    ) -> Result<&'s DeviceBuffer<i64>> {
        let s = room(staging, &self.device, at.len())?;
        s.pinned.as_mut_slice()?[..at.len()].copy_from_slice(at);
        s.device.copy_prefix_from_pinned(&s.pinned, at.len())?;
        Ok(&s.device)
    }

    /// The records `records`, packed back to back, copied to the pinned half of `down`
    /// (through `at` for their offsets): the values, once there.
    pub(crate) fn take_staged<'d>(
        &self,
        records: &[RecordAt],
        at: &mut Option<Staging<i64>>,
        down: &'d mut Option<Staging<f32>>,
    ) -> Result<&'d [f32]> {
        let (offsets, packed) = self.record_offsets(records)?;
        if packed == 0 {
            return Ok(&[]);
        }
        let d_at = self.stage_at(&offsets, at)?;
        let s = room(down, &self.device, packed)?;
        self.launch_records("cache_records_take", d_at, records.len(), &s.device)?;
        s.device.copy_prefix_to_pinned(&mut s.pinned, packed)?;
        Ok(&s.pinned.as_slice()?[..packed])
    }

    /// Room for `len` values in the pinned half of `up`, to fill with records before
    /// [`put_staged`](Self::put_staged).
    pub(crate) fn stage_up<'u>(
        &self,
        len: usize,
        up: &'u mut Option<Staging<f32>>,
    ) -> Result<&'u mut [f32]> {
        let s = room(up, &self.device, len)?;
        Ok(&mut s.pinned.as_mut_slice()?[..len])
    }

    /// Writes the records staged in `up` (by [`stage_up`](Self::stage_up), back to back) into
    /// the rows of `records`.
    pub(crate) fn put_staged(
        &self,
        records: &[RecordAt],
        at: &mut Option<Staging<i64>>,
        up: &mut Option<Staging<f32>>,
    ) -> Result<()> {
        let (offsets, packed) = self.record_offsets(records)?;
        if packed == 0 {
            return Ok(());
        }
        let s = match up {
            Some(s) if s.device.len() >= packed => s,
            _ => {
                return Err(Error::invalid(
                    "cached TBE",
                    format!("{packed} values to put, fewer staged (internal)"),
                ))
            }
        };
        s.device.copy_prefix_from_pinned(&s.pinned, packed)?;
        let d_at = self.stage_at(&offsets, at)?;
        self.launch_records("cache_records_put", d_at, records.len(), &s.device)
    }

    /// Launches `kernel` (`cache_records_take` or `cache_records_put`) on `n` records whose
    /// offsets (from [`record_offsets`](Self::record_offsets)) are `at`, packed in `packed`,
    /// which the caller made large enough for them all.
    fn launch_records(
        &self,
        kernel: &'static str,
        at: &DeviceBuffer<i64>,
        n: usize,
        packed: &DeviceBuffer<f32>,
    ) -> Result<()> {
        let [w, s0, s1] = self.record_buffers();
        // Every part lies inside its buffer (record_offsets) and `packed` holds them all.
        self.device.launch(
            CACHE.kernel(kernel),
            LaunchConfig::warp_per_item(n, WARPS),
            &args![*w, *s0, *s1, *at, n as i64, *packed],
        )
    }

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
    pub(crate) fn record_buffers(&self) -> [&DeviceBuffer<f32>; 3] {
        let Weights::F32(w) = &self.weights else {
            unreachable!("checked by record_offsets");
        };
        [
            w,
            self.state.first().unwrap_or(w),
            self.state.get(1).unwrap_or(w),
        ]
    }

    /// Copies `len` values at `from` in buffer `p` of `src` (in
    /// [`record_buffers`](Self::record_buffers)' order: weights, then the state buffers) to
    /// `to` in the same buffer here, on the device (queued on the current stream).
    pub(crate) fn copy_values_from(
        &self,
        src: &DeviceTables,
        p: usize,
        from: usize,
        to: usize,
        len: usize,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let (dst, src) = (self.record_buffers()[p], src.record_buffers()[p]);
        if from + len > src.len() || to + len > dst.len() {
            return Err(Error::invalid(
                "DeviceTables::copy_values_from",
                format!(
                    "{len} values from {from} of {} to {to} of {}",
                    src.len(),
                    dst.len()
                ),
            ));
        }
        (self.device).copy_on_device(dst.ptr_at(to), src.ptr_at(from), len * 4)
    }

    /// The records `records`, packed back to back, copied to the host.
    pub(crate) fn take_records(&self, records: &[RecordAt]) -> Result<Vec<f32>> {
        let (at, packed) = self.record_offsets(records)?;
        if packed == 0 {
            return Ok(Vec::new());
        }
        let d_at = self.device.htod(&at)?;
        let out = self.device.alloc::<f32>(packed)?;
        self.launch_records("cache_records_take", &d_at, records.len(), &out)?;
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
        let d_at = self.device.htod(&at)?;
        let d_packed = self.device.htod(packed)?;
        self.launch_records("cache_records_put", &d_at, records.len(), &d_packed)
    }
}
