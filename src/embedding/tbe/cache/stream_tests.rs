//! A GPU cache's prefetch stream, on the host emulation (which runs every launch to completion,
//! so it checks what is recorded and waited for, not the overlap itself).

use super::device_directory::tests::emulated;
use super::*;
use crate::embedding::input::{Batch, Ids};
use crate::embedding::optimizer::WeightDecay;
use crate::embedding::{PoolingMode, TableSpec};

/// One table of 300 rows of width 4, trained by SGD.
fn one_table() -> TbeConfig {
    TbeConfig::new(
        vec![TableSpec::new("t", 300, 4)],
        vec![0],
        PoolingMode::Sum,
        FusedOptimizer::Sgd { lr: 0.1 },
    )
}

fn batch(ids: Vec<i64>) -> Batch<'static> {
    let offsets = (0..=ids.len()).collect();
    Batch {
        batch_size: ids.len(),
        ids: Ids::I64(ids.into()),
        offsets,
        weights: None,
        num_features: 1,
        kept: None,
    }
}

/// A prefetch admits on its device's prefetch stream (its span there timed); the batch's
/// lookup (on the caller's stream) waits for it and notes its buffers as used there; its
/// lookup and backward leave the point its release waits for; an admission applies the
/// releases of batches admitted before the last one, not that one's.
#[test]
fn a_gpu_prefetch_admits_on_its_own_stream_and_the_release_waits_for_the_backward() {
    let Some(device) = emulated() else {
        return;
    };
    let config = one_table();
    let cache = CacheConfig::in_host_memory(CacheSize::LoadFactor(0.5));
    let mut c = CachedTables::create(&config, &cache, Some(device.clone())).unwrap();
    let caller = device.current_stream_id();
    let (first, second) = (batch((0..40).collect()), batch((20..70).collect()));

    c.prefetch(&config, &first).unwrap();
    let stream = c.prefetch_stream.as_ref().expect("a prefetch stream").id();
    assert_ne!(stream, caller);
    // Its admission's span, timed, given once.
    let [start, end] = c.take_prefetch_span().expect("the prefetch's span");
    assert!(start.elapsed_ms(&end).unwrap() >= 0.0);
    assert!(c.take_prefetch_span().is_none(), "the span was given twice");
    {
        let (_, _, kept) = c.prefetched.front().expect("the prefetched admission");
        assert!(
            kept.ready.is_some(),
            "no point recorded for the lookup to wait for"
        );
        let ids = &kept.on_device.as_ref().unwrap().ids;
        assert_eq!(ids.streams(), (Some(stream), vec![]));
    }
    let taken = c.admit(&config, &first).unwrap();
    assert!(
        c.prefetched.is_empty(),
        "the prefetched admission was not taken"
    );
    assert!(
        taken.ready.is_none(),
        "the lookup did not wait for the prefetch stream"
    );
    let on_device = taken.on_device.as_ref().unwrap();
    assert_eq!(on_device.ids.streams(), (Some(stream), vec![caller]));
    assert_eq!(on_device.offsets.streams().1, vec![caller]);
    let Locks::Device(slots, _) = &taken.lease.locked else {
        panic!("a device directory's admission locks on the device");
    };
    assert_eq!(slots.streams(), (Some(stream), vec![caller]));

    assert!(taken.lease.last_use.lock().is_none());
    let out = c.forward(&taken).unwrap();
    assert!(
        taken.lease.last_use.lock().is_some(),
        "the lookup left no point"
    );
    *taken.lease.last_use.lock() = None;
    let grad = device.htod(&vec![0.5f32; 40 * 4]).unwrap();
    let grad = crate::tensor::backend::cuda::from_buffer(grad, &[40, 4]).unwrap();
    assert_eq!(out.shape(), grad.shape());
    let sgd = FusedOptimizer::Sgd { lr: 0.1 };
    (c.backward_device(&taken, &grad, sgd, WeightDecay::None, 1)).unwrap();
    assert!(
        taken.lease.last_use.lock().is_some(),
        "the backward left no point"
    );

    // Batch 2 prefetched beside the backward, then batch 1 released: its locks (and the
    // point they wait for) wait for the next admission that admits (taking a prefetched one
    // does not).
    c.prefetch(&config, &second).unwrap();
    drop(taken);
    let next = c.admit(&config, &second).unwrap();
    {
        let released = c.released.lock();
        assert_eq!(released.len(), 1);
        assert!(released[0].1.is_some(), "the release waits for nothing");
    }
    // Batch 2 dropped too (as a training step drops its graph after the backward): the
    // prefetch of batch 3 releases batch 1 but keeps batch 2, the last one admitted, locked
    // through its admission, so that it need not wait for batch 2's backward.
    let grad = device.htod(&vec![0.5f32; 50 * 4]).unwrap();
    let grad = crate::tensor::backend::cuda::from_buffer(grad, &[50, 4]).unwrap();
    c.forward(&next).unwrap();
    (c.backward_device(&next, &grad, sgd, WeightDecay::None, 2)).unwrap();
    drop(next);
    c.prefetch(&config, &batch((100..110).collect())).unwrap();
    {
        let released = c.released.lock();
        assert_eq!(
            released.len(),
            1,
            "batch 2 was released by batch 3's admission"
        );
        assert_eq!(released[0].2, 2);
    }
    // Rows 20..70 of batch 2 and batch 3's 10.
    assert_eq!(c.locked_slots().unwrap()[0], 60);
    c.drain_released().unwrap();
    assert!(c.released.lock().is_empty());
    assert_eq!(c.locked_slots().unwrap()[0], 10);
}

/// A cache configured to prefetch on the caller's stream admits there (and times no span
/// of a prefetch stream).
#[test]
fn a_gpu_cache_can_prefetch_on_the_callers_stream() {
    let Some(device) = emulated() else {
        return;
    };
    let config = one_table();
    let cache =
        CacheConfig::in_host_memory(CacheSize::LoadFactor(0.5)).with_prefetch_on_side_stream(false);
    let mut c = CachedTables::create(&config, &cache, Some(device.clone())).unwrap();
    c.prefetch(&config, &batch((0..40).collect())).unwrap();
    assert!(c.prefetch_stream.is_none());
    assert!(c.take_prefetch_span().is_none());
    let (_, _, kept) = c.prefetched.front().expect("the prefetched admission");
    let caller = device.current_stream_id();
    let ids = &kept.on_device.as_ref().unwrap().ids;
    assert_eq!(ids.streams(), (Some(caller), vec![]));
}
