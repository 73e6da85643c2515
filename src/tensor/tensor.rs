//! The `Tensor` type: a cheap-to-clone handle on shared storage plus a strided view of it, and,
//! when it takes part in autograd, the node that produced it.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::{MappedRwLockWriteGuard, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use rand::Rng;
use rand_distr::{Distribution, StandardNormal};

use super::autograd::{self, Gradient, Node};
use super::backend::{with_backend, CopyOps};
use super::dtype::{DType, WithDType};
use super::layout::Layout;
use super::storage::{match_storage, CpuStorage, Storage};
use crate::{Device, Error, Result};

static NEXT_TENSOR_ID: AtomicUsize = AtomicUsize::new(0);

/// An n-dimensional array with reverse-mode autograd.
///
/// Cloning is cheap (a reference count). Views — [`reshape`](Tensor::reshape) of a contiguous
/// tensor, [`transpose`](Tensor::transpose), [`permute`](Tensor::permute),
/// [`narrow`](Tensor::narrow), [`expand`](Tensor::expand) — share storage and copy nothing.
#[derive(Clone)]
pub struct Tensor(Arc<TensorImpl>);

pub(crate) struct TensorImpl {
    id: usize,
    storage: Arc<Shared>,
    layout: Layout,
    dtype: DType,
    requires_grad: bool,
    grad_fn: Option<Arc<Node>>,
    grad: Mutex<Option<Gradient>>,
}

/// The storage every view of a tensor shares, with its version: how many times it was written
/// in place (`copy_from`, `update_in_place`, `data_mut`, `move_to_device`, an optimizer
/// step). A backward checks the versions of the tensors it saved ([`SavedTensor`]), as
/// PyTorch does, so that values changed after the forward never reach a gradient silently.
///
/// [`SavedTensor`]: super::autograd::SavedTensor
pub(crate) struct Shared {
    data: RwLock<Storage>,
    version: AtomicU64,
}

impl Shared {
    fn new(storage: Storage) -> Arc<Shared> {
        Arc::new(Shared {
            data: RwLock::new(storage),
            version: AtomicU64::new(0),
        })
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tensor(shape={:?}, dtype={:?}, device={}",
            self.shape(),
            self.dtype(),
            self.device()
        )?;
        if let Some(node) = self.grad_fn() {
            write!(f, ", grad_fn={}", node.name())?;
        } else if self.requires_grad() {
            write!(f, ", requires_grad")?;
        }
        if self.numel() <= 16 {
            if let Ok(v) = self.to_vec_f64() {
                write!(f, ", values={v:?}")?;
            }
        }
        write!(f, ")")
    }
}

/// The elements of `shape`; `None` when past a `usize`.
pub(crate) fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

/// The sum of `sizes`; `None` when past a `usize`.
pub(crate) fn checked_sum(sizes: &[usize]) -> Option<usize> {
    sizes.iter().try_fold(0usize, |n, &s| n.checked_add(s))
}

/// The bytes of `shape` elements of `elem_bytes` each; `None` when no memory can address
/// them (past `isize::MAX`), so that allocating them would panic rather than fail.
pub(crate) fn addressable_bytes(shape: &[usize], elem_bytes: usize) -> Option<usize> {
    (checked_numel(shape)?.checked_mul(elem_bytes)).filter(|&b| b <= isize::MAX as usize)
}

impl Tensor {
    // ----- construction -------------------------------------------------------------------

    fn from_parts(storage: Arc<Shared>, layout: Layout, dtype: DType) -> Tensor {
        Tensor(Arc::new(TensorImpl {
            id: NEXT_TENSOR_ID.fetch_add(1, Ordering::Relaxed),
            storage,
            layout,
            dtype,
            requires_grad: false,
            grad_fn: None,
            grad: Mutex::new(None),
        }))
    }

    /// A new contiguous tensor owning `storage`, with no autograd history.
    pub fn from_storage(storage: CpuStorage, shape: &[usize]) -> Result<Tensor> {
        let n = checked_numel(shape);
        if n != Some(storage.len()) {
            return Err(Error::invalid(
                "from_storage",
                format!(
                    "{} elements given for shape {shape:?} ({} elements)",
                    storage.len(),
                    n.map_or("past a usize".to_string(), |n| n.to_string())
                ),
            ));
        }
        Ok(Tensor::from_cpu(storage, shape))
    }

    /// Infallible internal constructor; the caller guarantees `storage.len() == numel(shape)`.
    pub(crate) fn from_cpu(storage: CpuStorage, shape: &[usize]) -> Tensor {
        debug_assert_eq!(storage.len(), shape.iter().product::<usize>());
        let dtype = storage.dtype();
        Tensor::from_parts(
            Shared::new(Storage::Cpu(storage)),
            Layout::contiguous(shape),
            dtype,
        )
    }

    /// Internal constructor over device storage of `numel(shape)` elements.
    pub(crate) fn from_cuda(storage: super::backend::CudaStorage, shape: &[usize]) -> Tensor {
        debug_assert_eq!(storage.len, shape.iter().product::<usize>());
        let dtype = storage.dtype;
        Tensor::from_parts(
            Shared::new(Storage::Cuda(storage)),
            Layout::contiguous(shape),
            dtype,
        )
    }

    /// A tensor of `shape` holding `data` in row-major order.
    pub fn from_vec<T: WithDType>(data: Vec<T>, shape: &[usize]) -> Result<Tensor> {
        Tensor::from_storage(T::into_storage(data), shape)
    }

    /// A tensor of `shape` holding a copy of `data`.
    pub fn from_slice<T: WithDType>(data: &[T], shape: &[usize]) -> Result<Tensor> {
        Tensor::from_vec(data.to_vec(), shape)
    }

    /// A 0-dimensional tensor.
    pub fn scalar<T: WithDType>(value: T) -> Tensor {
        Tensor::from_cpu(T::into_storage(vec![value]), &[])
    }

    /// A tensor filled with `value` (converted to `dtype`) on `device`.
    ///
    /// # Panics
    /// On a CUDA device that cannot be opened or is out of memory (a `Device::Cuda` comes from
    /// [`Device::cuda`], which opened it, or from an existing tensor); [`Tensor::try_full`]
    /// returns the error instead.
    pub fn full(value: f64, shape: &[usize], dtype: DType, device: Device) -> Tensor {
        Tensor::try_full(value, shape, dtype, device)
            .unwrap_or_else(|e| panic!("Tensor::full on {device}: {e}"))
    }

    /// [`Tensor::full`], with device errors returned (and shapes past any memory).
    pub fn try_full(value: f64, shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        if addressable_bytes(shape, dtype.size_in_bytes()).is_none() {
            return Err(Error::invalid(
                "Tensor::full",
                format!("shape {shape:?} of {dtype:?} is past any memory"),
            ));
        }
        with_backend!(device, B => B::full(value, shape, dtype, device))
    }

    /// A tensor of zeros on `device` (panics as [`Tensor::full`] does).
    pub fn zeros(shape: &[usize], dtype: DType, device: Device) -> Tensor {
        Tensor::full(0.0, shape, dtype, device)
    }

    /// [`Tensor::zeros`], with device errors returned.
    pub fn try_zeros(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::try_full(0.0, shape, dtype, device)
    }

    /// A tensor of ones (panics as [`Tensor::full`] does).
    pub fn ones(shape: &[usize], dtype: DType, device: Device) -> Tensor {
        Tensor::full(1.0, shape, dtype, device)
    }

    /// [`Tensor::ones`], with device errors returned.
    pub fn try_ones(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::try_full(1.0, shape, dtype, device)
    }

    /// Zeros with this tensor's shape, dtype and device (panics as [`Tensor::full`] does).
    pub fn zeros_like(&self) -> Tensor {
        Tensor::zeros(self.shape(), self.dtype(), self.device())
    }

    /// [`Tensor::zeros_like`], with device errors returned.
    pub fn try_zeros_like(&self) -> Result<Tensor> {
        Tensor::try_zeros(self.shape(), self.dtype(), self.device())
    }

    /// Ones with this tensor's shape, dtype and device (panics as [`Tensor::full`] does).
    pub fn ones_like(&self) -> Tensor {
        Tensor::ones(self.shape(), self.dtype(), self.device())
    }

    /// [`Tensor::ones_like`], with device errors returned.
    pub fn try_ones_like(&self) -> Result<Tensor> {
        Tensor::try_ones(self.shape(), self.dtype(), self.device())
    }

    /// `[start, start+1, ..., end-1]` as a 1-D tensor of `dtype`.
    pub fn arange(start: i64, end: i64, dtype: DType) -> Tensor {
        let v: Vec<f64> = (start..end.max(start)).map(|x| x as f64).collect();
        let n = v.len();
        Tensor::from_cpu(CpuStorage::F64(v), &[n])
            .cast_values(dtype)
            .expect("arange: casting from f64 cannot fail")
    }

    /// Samples from N(mean, std²), drawn in f64 and stored as `dtype` (a float dtype); panics
    /// where [`Tensor::try_randn`] returns an error.
    pub fn randn(shape: &[usize], mean: f64, std: f64, dtype: DType, rng: &mut impl Rng) -> Tensor {
        Tensor::try_randn(shape, mean, std, dtype, rng).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Tensor::randn`], with an error for a mean that is not finite, a standard deviation
    /// that is not finite and at least 0 (a NaN one filled the tensor with NaN), or an
    /// allocation the allocator refuses.
    pub fn try_randn(
        shape: &[usize],
        mean: f64,
        std: f64,
        dtype: DType,
        rng: &mut impl Rng,
    ) -> Result<Tensor> {
        if !(mean.is_finite() && std.is_finite() && std >= 0.0) {
            return Err(Error::invalid(
                "Tensor::randn",
                format!("N({mean}, {std}²): the mean must be finite, the std finite and ≥ 0"),
            ));
        }
        Tensor::sampled("Tensor::randn", shape, dtype, || {
            let z: f64 = StandardNormal.sample(rng);
            mean + std * z
        })
    }

    /// Samples uniformly from `[low, high)`, stored as `dtype` (a float dtype); panics where
    /// [`Tensor::try_rand_uniform`] returns an error.
    pub fn rand_uniform(
        shape: &[usize],
        low: f64,
        high: f64,
        dtype: DType,
        rng: &mut impl Rng,
    ) -> Tensor {
        Tensor::try_rand_uniform(shape, low, high, dtype, rng).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Tensor::rand_uniform`], with an error for a range that is empty or not of a finite
    /// width (the sampler panicked), or an allocation the allocator refuses.
    pub fn try_rand_uniform(
        shape: &[usize],
        low: f64,
        high: f64,
        dtype: DType,
        rng: &mut impl Rng,
    ) -> Result<Tensor> {
        if low.partial_cmp(&high) != Some(std::cmp::Ordering::Less) || !(high - low).is_finite() {
            return Err(Error::invalid(
                "Tensor::rand_uniform",
                format!("[{low}, {high}) is empty or not of a finite width"),
            ));
        }
        Tensor::sampled("Tensor::rand_uniform", shape, dtype, || {
            rng.random_range(low..high)
        })
    }

    /// `shape`'s elements drawn by `draw` in f64, stored as `dtype`; an allocation the
    /// allocator refuses is an error naming `what`.
    fn sampled(
        what: &'static str,
        shape: &[usize],
        dtype: DType,
        mut draw: impl FnMut() -> f64,
    ) -> Result<Tensor> {
        let n = checked_numel(shape)
            .ok_or_else(|| Error::invalid(what, format!("shape {shape:?} is past any memory")))?;
        let mut v = super::storage::try_with_capacity::<f64>(what, n)?;
        v.extend((0..n).map(|_| draw()));
        Tensor::from_cpu(CpuStorage::F64(v), shape).cast_values(dtype)
    }

    // ----- metadata -----------------------------------------------------------------------

    /// Unique id of this tensor handle (views get their own id).
    pub fn id(&self) -> usize {
        self.0.id
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        self.0.layout.shape()
    }

    /// Size of dimension `dim` (negative counts from the end).
    pub fn dim(&self, dim: isize) -> Result<usize> {
        let d = super::layout::resolve_dim("dim", dim, self.rank())?;
        Ok(self.shape()[d])
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.shape().len()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.0.layout.numel()
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.0.dtype
    }

    /// Device of the storage.
    pub fn device(&self) -> Device {
        self.0.storage.data.read_recursive().device()
    }

    /// The strided layout.
    pub fn layout(&self) -> &Layout {
        &self.0.layout
    }

    /// True when the view is row-major without gaps.
    pub fn is_contiguous(&self) -> bool {
        self.0.layout.is_contiguous()
    }

    /// True when two handles view the same storage.
    pub fn shares_storage_with(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.0.storage, &other.0.storage)
    }

    // ----- data access --------------------------------------------------------------------

    pub(crate) fn storage_read(&self) -> RwLockReadGuard<'_, Storage> {
        // Recursive reads: an op may read the same storage through two operands (x * x).
        self.0.storage.data.read_recursive()
    }

    /// How many times this tensor's storage (shared by all its views) was written in place
    /// since it was made: `copy_from`, `update_in_place`, `data_mut`, `move_to_device` and
    /// the optimizers' steps each count one. Ops never write their inputs, so a tensor no one
    /// changed in place stays at 0. Like PyTorch's `_version`.
    pub fn version(&self) -> u64 {
        self.0.storage.version.load(Ordering::Acquire)
    }

    /// Counts an in-place write of this tensor's storage (see [`version`](Self::version)),
    /// for writers that reach the storage without a write guard (device kernels).
    pub(crate) fn mark_modified(&self) {
        self.0.storage.version.fetch_add(1, Ordering::AcqRel);
    }

    fn wrong_dtype<T: WithDType>(&self, op: &'static str) -> Error {
        Error::DTypeMismatch {
            op,
            lhs: self.dtype(),
            rhs: T::DTYPE,
        }
    }

    /// Calls `f` with the elements in row-major order: the storage itself when contiguous, a
    /// gathered copy otherwise. Errors if `T` is not this tensor's dtype.
    pub fn with_contiguous<T: WithDType, R>(&self, f: impl FnOnce(&[T]) -> R) -> Result<R> {
        let guard = self.storage_read();
        let data = T::slice(guard.cpu("with_contiguous")?)
            .ok_or_else(|| self.wrong_dtype::<T>("with_contiguous"))?;
        let layout = &self.0.layout;
        if layout.is_contiguous() {
            let n = layout.numel();
            Ok(f(&data[layout.offset()..layout.offset() + n]))
        } else {
            let v = layout.gather(data);
            Ok(f(&v))
        }
    }

    /// Calls `f` with the raw storage buffer and this view's layout (for strided kernels).
    pub fn with_strided<T: WithDType, R>(&self, f: impl FnOnce(&[T], &Layout) -> R) -> Result<R> {
        let guard = self.storage_read();
        let data = T::slice(guard.cpu("with_strided")?)
            .ok_or_else(|| self.wrong_dtype::<T>("with_strided"))?;
        Ok(f(data, &self.0.layout))
    }

    /// Mutates the elements in place. Only for contiguous tensors (parameters, optimizer state);
    /// every view sharing the storage sees the change. Bypasses autograd: use it for updates
    /// that happen outside the graph, like optimizer steps.
    pub fn update_in_place<T: WithDType, R>(&self, f: impl FnOnce(&mut [T]) -> R) -> Result<R> {
        if !self.is_contiguous() {
            return Err(Error::invalid(
                "update_in_place",
                format!("the tensor of shape {:?} is not contiguous", self.shape()),
            ));
        }
        let mut guard = self.0.storage.data.write();
        let dtype = self.dtype();
        let data = T::slice_mut(guard.cpu_mut("update_in_place")?).ok_or(Error::DTypeMismatch {
            op: "update_in_place",
            lhs: dtype,
            rhs: T::DTYPE,
        })?;
        let (o, n) = (self.0.layout.offset(), self.numel());
        // Counted once the write can no longer be refused (under the lock).
        self.mark_modified();
        Ok(f(&mut data[o..o + n]))
    }

    /// A write guard over the elements of a contiguous tensor, for kernels that update several
    /// tensors at once (optimizer steps). Bypasses autograd. Two guards on tensors sharing
    /// storage would deadlock: only take guards on distinct tensors.
    pub fn data_mut<T: WithDType>(&self) -> Result<MappedRwLockWriteGuard<'_, [T]>> {
        if !self.is_contiguous() {
            return Err(Error::invalid(
                "data_mut",
                format!("the tensor of shape {:?} is not contiguous", self.shape()),
            ));
        }
        let (o, n) = (self.0.layout.offset(), self.numel());
        let dtype = self.dtype();
        let guard = self.0.storage.data.write();
        guard.cpu("data_mut")?;
        let guard = RwLockWriteGuard::try_map(guard, |s| match s {
            Storage::Cpu(cpu) => T::slice_mut(cpu).map(|d| &mut d[o..o + n]),
            Storage::Cuda(_) => None,
        })
        .map_err(|_| Error::DTypeMismatch {
            op: "data_mut",
            lhs: dtype,
            rhs: T::DTYPE,
        })?;
        // Counted once the write can no longer be refused (under the lock).
        self.mark_modified();
        Ok(guard)
    }

    /// Moves this leaf's values to `device` in place: every handle on it (a module's parameter,
    /// an optimizer's list of parameters) then lives on `device`. Its gradient is cleared. Only
    /// for contiguous leaves that are their storage's only view (parameters, buffers).
    pub fn move_to_device(&self, device: Device) -> Result<()> {
        if self.device() == device {
            return Ok(());
        }
        let whole = {
            let g = self.storage_read();
            let len = match &*g {
                Storage::Cpu(c) => c.len(),
                Storage::Cuda(c) => c.len,
            };
            len == self.numel() && self.0.layout.offset() == 0
        };
        if !self.is_leaf() || !self.is_contiguous() || !whole {
            return Err(Error::invalid(
                "move_to_device",
                format!(
                    "only a contiguous leaf owning its whole storage moves in place (shape {:?}); \
                     use to_device for a moved copy",
                    self.shape()
                ),
            ));
        }
        let moved = self.to_device_values(device)?;
        let storage = std::mem::replace(
            &mut *moved.0.storage.data.write(),
            Storage::Cpu(CpuStorage::zeros(self.dtype(), 0)),
        );
        *self.0.storage.data.write() = storage;
        self.mark_modified();
        self.zero_grad();
        Ok(())
    }

    /// Copies `src`'s values into this tensor in place (same shape; cast to this dtype).
    pub fn copy_from(&self, src: &Tensor) -> Result<()> {
        if src.shape() != self.shape() {
            return Err(Error::shape("copy_from", self.shape(), src.shape()));
        }
        with_backend!(self.device(), B => B::copy_into(self, src))
    }

    /// The elements in row-major order. `T` must be the tensor's dtype. A tensor on a CUDA
    /// device is copied back (waiting for the work queued before).
    pub fn to_vec<T: WithDType>(&self) -> Result<Vec<T>> {
        self.to_host_values()?.with_contiguous(|s: &[T]| s.to_vec())
    }

    /// The elements in row-major order, converted to f64 (any dtype; copied back from a CUDA
    /// device).
    pub fn to_vec_f64(&self) -> Result<Vec<f64>> {
        let host = self.to_host_values()?;
        let guard = host.storage_read();
        let cpu = guard.cpu("to_vec_f64")?;
        Ok(
            match_storage!(cpu, v => host.0.layout.gather(v).into_iter().map(|x| x.to_f64()).collect()),
        )
    }

    /// The single element of a one-element tensor, as `T` (must be the tensor's dtype).
    pub fn to_scalar<T: WithDType>(&self) -> Result<T> {
        if self.numel() != 1 {
            return Err(Error::invalid(
                "to_scalar",
                format!(
                    "expected one element, the tensor has shape {:?}",
                    self.shape()
                ),
            ));
        }
        Ok(self.to_vec::<T>()?[0])
    }

    /// The single element of a one-element tensor, as f64 (any dtype).
    pub fn item(&self) -> Result<f64> {
        if self.numel() != 1 {
            return Err(Error::invalid(
                "item",
                format!(
                    "expected one element, the tensor has shape {:?}",
                    self.shape()
                ),
            ));
        }
        Ok(self.to_vec_f64()?[0])
    }

    // ----- internal building blocks for ops ------------------------------------------------

    /// A view of the same storage with another layout and no autograd history.
    pub(crate) fn view_with_layout(&self, layout: Layout) -> Tensor {
        Tensor::from_parts(self.0.storage.clone(), layout, self.0.dtype)
    }

    /// A contiguous tensor with the same values and no autograd history (no copy if already
    /// contiguous).
    pub(crate) fn contiguous_values(&self) -> Result<Tensor> {
        if self.is_contiguous() && self.0.layout.offset() == 0 && self.storage_len() == self.numel()
        {
            return Ok(self.detach());
        }
        with_backend!(self.device(), B => B::contiguous(self))
    }

    /// This tensor's values in host memory, without autograd history (the same storage when
    /// already there; copied back from a device, waiting for the work queued before).
    pub(crate) fn to_host_values(&self) -> Result<Tensor> {
        with_backend!(self.device(), B => B::to_host(self))
    }

    /// This tensor's values on `device`, without autograd history.
    pub(crate) fn to_device_values(&self, device: Device) -> Result<Tensor> {
        if self.device() == device {
            return Ok(self.detach());
        }
        let host = self.to_host_values()?;
        with_backend!(device, B => B::from_host(&host, device))
    }

    /// Elements in this tensor's storage (its views may see fewer).
    pub(crate) fn storage_len(&self) -> usize {
        match &*self.storage_read() {
            Storage::Cpu(s) => s.len(),
            Storage::Cuda(s) => s.len,
        }
    }

    /// Values converted to `dtype`, without autograd history (same handle if already `dtype`).
    pub(crate) fn cast_values(&self, dtype: DType) -> Result<Tensor> {
        if dtype == self.dtype() {
            return Ok(self.detach());
        }
        with_backend!(self.device(), B => B::cast(self, dtype))
    }

    // ----- autograd -----------------------------------------------------------------------

    /// True when gradients flow to or through this tensor.
    pub fn requires_grad(&self) -> bool {
        self.0.requires_grad
    }

    /// A leaf handle on the same storage with `requires_grad` set (for parameters). The result
    /// has no history: gradients accumulate on it.
    pub fn with_requires_grad(&self, requires_grad: bool) -> Tensor {
        Tensor(Arc::new(TensorImpl {
            id: NEXT_TENSOR_ID.fetch_add(1, Ordering::Relaxed),
            storage: self.0.storage.clone(),
            layout: self.0.layout.clone(),
            dtype: self.0.dtype,
            requires_grad,
            grad_fn: None,
            grad: Mutex::new(None),
        }))
    }

    /// Same storage and values, cut from the autograd graph.
    pub fn detach(&self) -> Tensor {
        self.view_with_layout(self.0.layout.clone())
    }

    /// The node that produced this tensor, if it was computed from tensors requiring grad.
    pub fn grad_fn(&self) -> Option<&Arc<Node>> {
        self.0.grad_fn.as_ref()
    }

    /// True for tensors not produced by a recorded op.
    pub fn is_leaf(&self) -> bool {
        self.0.grad_fn.is_none()
    }

    pub(crate) fn with_grad_fn(self, node: Arc<Node>) -> Tensor {
        Tensor(Arc::new(TensorImpl {
            id: self.0.id,
            storage: self.0.storage.clone(),
            layout: self.0.layout.clone(),
            dtype: self.0.dtype,
            requires_grad: true,
            grad_fn: Some(node),
            grad: Mutex::new(None),
        }))
    }

    /// The accumulated gradient of a leaf, densified.
    pub fn grad(&self) -> Option<Tensor> {
        let g = self.0.grad.lock().clone()?;
        g.to_dense().ok()
    }

    /// The accumulated gradient of a leaf as it was stored (dense or row-sparse).
    pub fn gradient(&self) -> Option<Gradient> {
        self.0.grad.lock().clone()
    }

    /// Clears the accumulated gradient.
    pub fn zero_grad(&self) {
        *self.0.grad.lock() = None;
    }

    /// Replaces the accumulated gradient (e.g. with its average over data-parallel ranks);
    /// `grad` must have this tensor's shape and dtype.
    pub fn set_grad(&self, grad: Tensor) -> Result<()> {
        if grad.shape() != self.shape() || grad.dtype() != self.dtype() {
            return Err(Error::invalid(
                "set_grad",
                format!(
                    "a {:?} {:?} gradient for a {:?} {:?} tensor",
                    grad.dtype(),
                    grad.shape(),
                    self.dtype(),
                    self.shape()
                ),
            ));
        }
        *self.0.grad.lock() = Some(Gradient::Dense(grad));
        Ok(())
    }

    pub(crate) fn accumulate_grad(&self, g: Gradient) -> Result<()> {
        let mut slot = self.0.grad.lock();
        *slot = Some(match slot.take() {
            Some(prev) => prev.accumulate(g)?,
            None => g,
        });
        Ok(())
    }

    /// Back-propagates from a one-element tensor (seed gradient 1), accumulating into the
    /// leaves' gradients and freeing the graph's saved state.
    pub fn backward(&self) -> Result<()> {
        if self.numel() != 1 {
            return Err(Error::Backward(format!(
                "backward() without a gradient needs a one-element tensor, this one has shape \
                 {:?}; use backward_with",
                self.shape()
            )));
        }
        autograd::run_backward(self, self.try_ones_like()?, false)
    }

    /// Back-propagates with an explicit upstream gradient. With `retain_graph` the saved state
    /// is kept so backward can run through the graph again.
    pub fn backward_with(&self, grad: &Tensor, retain_graph: bool) -> Result<()> {
        if grad.dtype() != self.dtype() {
            return Err(Error::DTypeMismatch {
                op: "backward_with",
                lhs: self.dtype(),
                rhs: grad.dtype(),
            });
        }
        autograd::run_backward(self, grad.detach(), retain_graph)
    }
}
