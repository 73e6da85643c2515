//! Streams: independent queues of work on one device, as PyTorch's `torch.cuda.Stream`.
//!
//! Every device starts with its default stream; [`CudaDevice::new_stream`] makes more. Work
//! (kernels, copies, cuBLAS products, allocations) goes to the calling thread's *current*
//! stream of the device — the default one unless [`Stream::run`] made another current for a
//! closure. Work on one stream runs in order; work on different streams may overlap, so a
//! stream that needs another's results waits for them ([`Stream::wait_for`]).
//!
//! Memory: a block belongs to the stream it was allocated on, and a freed block is handed out
//! again at once to later work of that stream (stream order makes that safe). A buffer also
//! used on other streams must say so ([`DeviceBuffer::record_stream`]): when it is freed, its
//! block waits in [`PendingFrees`] until the work those streams had queued by then is done.

use std::cell::RefCell;
use std::sync::Arc;

use super::allocator::{Block, StreamId};
use super::{CudaDevice, DeviceBuffer, DeviceElem};
use crate::Result;

/// The id of every device's default stream.
pub(crate) const DEFAULT_STREAM: StreamId = 0;

thread_local! {
    /// Per device (keyed by its address): this thread's current stream, when not the default.
    static CURRENT: RefCell<Vec<(usize, StreamId)>> = const { RefCell::new(Vec::new()) };
}

fn device_key(device: &CudaDevice) -> usize {
    device as *const CudaDevice as usize
}

/// This thread's current stream of `device`.
pub(crate) fn current_stream_id(device: &CudaDevice) -> StreamId {
    let key = device_key(device);
    CURRENT.with(|c| {
        c.borrow()
            .iter()
            .rev()
            .find(|(k, _)| *k == key)
            .map_or(DEFAULT_STREAM, |&(_, s)| s)
    })
}

/// A queue of work on a device, as PyTorch's `torch.cuda.Stream`. Work on one stream runs in
/// order; work on different streams may overlap, so a stream that needs another's results
/// waits for them ([`Stream::wait_for`]). Kernels, copies, products and allocations go to the
/// calling thread's current stream of the device ([`Stream::run`]); a buffer used on a stream
/// other than the one it was allocated on must be recorded there
/// ([`DeviceBuffer::record_stream`]).
#[derive(Clone)]
pub struct Stream {
    device: Arc<CudaDevice>,
    id: StreamId,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stream(cuda:{}, {})", self.device.ordinal(), self.id)
    }
}

impl PartialEq for Stream {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.device, &other.device) && self.id == other.id
    }
}

impl Stream {
    pub(crate) fn new(device: Arc<CudaDevice>, id: StreamId) -> Self {
        Stream { device, id }
    }

    /// The stream's id on its device (0: the default stream).
    pub fn id(&self) -> StreamId {
        self.id
    }

    /// The device the stream belongs to.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    /// Runs `f` with this stream as the calling thread's current stream of its device (the
    /// previous one is current again afterwards, also when `f` panics).
    pub fn run<R>(&self, f: impl FnOnce() -> R) -> R {
        struct Restore;
        impl Drop for Restore {
            fn drop(&mut self) {
                CURRENT.with(|c| c.borrow_mut().pop());
            }
        }
        let key = device_key(&self.device);
        CURRENT.with(|c| c.borrow_mut().push((key, self.id)));
        let _restore = Restore;
        f()
    }

    /// Makes the work queued on this stream from now on wait for the work queued on `other`
    /// so far (without blocking the host).
    pub fn wait_for(&self, other: &Stream) -> Result<()> {
        if !Arc::ptr_eq(&self.device, &other.device) {
            return Err(crate::Error::DeviceMismatch {
                op: "Stream::wait_for",
                lhs: crate::Device::Cuda(self.device.ordinal()),
                rhs: crate::Device::Cuda(other.device.ordinal()),
            });
        }
        if self.id == other.id {
            return Ok(());
        }
        self.device.stream_wait(self.id, other.id)
    }

    /// Blocks the host until the work queued on this stream so far is done.
    pub fn synchronize(&self) -> Result<()> {
        self.device.synchronize_stream(self.id)
    }
}

impl<T: DeviceElem> DeviceBuffer<T> {
    /// Notes that work on `stream` uses this buffer (PyTorch's `record_stream`): when the
    /// buffer is freed, its memory is not handed out again before the work queued on `stream`
    /// by then is done. Needed only for streams other than the one the buffer was allocated on.
    pub fn record_stream(&self, stream: &Stream) {
        self.note_stream(stream.id);
    }
}

/// Whether a queued point of a stream has been reached ([`PendingFrees`]).
pub(crate) trait Completion {
    /// True once reached (never blocks).
    fn is_done(&self) -> bool;
    /// Blocks until reached.
    fn wait(&self);
}

impl Completion for cudarc::driver::CudaEvent {
    fn is_done(&self) -> bool {
        // An error reads as done: the device is then unusable anyway, and holding memory
        // back forever would only hide that.
        self.try_is_complete().unwrap_or(true)
    }
    fn wait(&self) {
        let _ = self.synchronize();
    }
}

/// Freed blocks that other streams may still be using, each with the points of those streams
/// it waits for.
pub(crate) struct PendingFrees<E> {
    pending: Vec<(Block, Vec<E>)>,
}

impl<E: Completion> PendingFrees<E> {
    pub(crate) fn new() -> Self {
        PendingFrees {
            pending: Vec::new(),
        }
    }

    /// Holds `block` back until every one of `events` is reached.
    pub(crate) fn push(&mut self, block: Block, events: Vec<E>) {
        self.pending.push((block, events));
    }

    /// The blocks whose events are all reached, removed from the list.
    pub(crate) fn take_ready(&mut self) -> Vec<Block> {
        let mut ready = Vec::new();
        self.pending.retain(|(block, events)| {
            let done = events.iter().all(Completion::is_done);
            if done {
                ready.push(*block);
            }
            !done
        });
        ready
    }

    /// Waits for every pending block's events and returns them all.
    pub(crate) fn take_all(&mut self) -> Vec<Block> {
        self.pending
            .drain(..)
            .map(|(block, events)| {
                events.iter().for_each(Completion::wait);
                block
            })
            .collect()
    }

    /// Number of blocks held back.
    pub(crate) fn len(&self) -> usize {
        self.pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::rc::Rc;

    /// A fake stream point, reached when the shared clock passes it.
    struct Point(Rc<Cell<u32>>, u32);

    impl Completion for Point {
        fn is_done(&self) -> bool {
            self.0.get() >= self.1
        }
        fn wait(&self) {
            self.0.set(self.0.get().max(self.1));
        }
    }

    fn block(ptr: u64) -> Block {
        Block {
            ptr,
            size: 512,
            stream: 0,
        }
    }

    #[test]
    fn blocks_come_back_only_when_every_stream_they_wait_for_is_there() {
        let clock = Rc::new(Cell::new(0));
        let mut p = PendingFrees::new();
        p.push(block(1), vec![Point(clock.clone(), 2)]);
        p.push(
            block(2),
            vec![Point(clock.clone(), 1), Point(clock.clone(), 3)],
        );
        p.push(block(3), vec![Point(clock.clone(), 1)]);
        assert!(p.take_ready().is_empty());
        clock.set(1);
        assert_eq!(p.take_ready(), vec![block(3)]);
        clock.set(2);
        assert_eq!(p.take_ready(), vec![block(1)]);
        assert_eq!(p.len(), 1);
        // Out of memory: wait for the rest.
        assert_eq!(p.take_all(), vec![block(2)]);
        assert_eq!(clock.get(), 3);
        assert_eq!(p.len(), 0);
    }
}
