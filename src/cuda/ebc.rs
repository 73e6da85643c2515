//! [`CudaEmbeddingBagCollection`]: an [`EmbeddingBagCollection`]'s tables on a CUDA device,
//! looked up into device tensors that take part in autograd; the backward runs the fused
//! optimizer on the device ([`CudaTbe::backward`]).

use std::sync::Arc;

use parking_lot::Mutex;

use super::{CudaDevice, CudaTbe};
use crate::embedding::{EmbeddingBagCollection, SparseTableGrad};
use crate::sparse::ops::read_ints;
use crate::sparse::{KeyedJaggedTensor, KeyedTensor};
use crate::tensor::autograd::{record_op_with_state, BackwardOp, Gradient};
use crate::{DType, Device, Error, Result, Tensor};

const OP: &str = "CudaEmbeddingBagCollection";

/// One pooling group: its tables on the device and the features it serves, in order.
struct Group {
    tbe: Arc<Mutex<CudaTbe>>,
    features: Vec<String>,
    /// Names of the group's tables, in the TBE's order.
    tables: Vec<String>,
    /// Without a fused optimizer: each table's row-sparse gradient summed over the backward
    /// calls since the last [`CudaEmbeddingBagCollection::zero_sparse_gradients`].
    sparse: Arc<Mutex<Vec<Option<SparseTableGrad>>>>,
}

/// The tables of an [`EmbeddingBagCollection`] on a CUDA device (TorchRec's EBC moved to
/// `cuda`): same features, pooling, fused optimizer and weight decay (the tables' values,
/// optimizer state and step count are copied over). [`forward`](Self::forward) takes the KJT
/// from host memory, checks it there, and returns pooled embeddings on the device;
/// `backward` on anything computed from them updates the tables in place — or, for tables
/// without a fused optimizer, leaves them as they are and sums their row-sparse gradients
/// ([`sparse_gradient`](Self::sparse_gradient)), as the CPU collection does.
pub struct CudaEmbeddingBagCollection {
    groups: Vec<Group>,
    output_keys: Vec<String>,
    output_dims: Vec<usize>,
    device: Arc<CudaDevice>,
}

impl std::fmt::Debug for CudaEmbeddingBagCollection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaEmbeddingBagCollection")
            .field("device", &self.device.name())
            .field("output_keys", &self.output_keys)
            .finish()
    }
}

impl CudaEmbeddingBagCollection {
    /// A copy of `ebc`'s tables and optimizer state on CUDA device `device`.
    pub fn new(ebc: &EmbeddingBagCollection, device: Device) -> Result<Self> {
        let dev = crate::tensor::cuda::open(device)?;
        let mut groups = Vec::new();
        for (tbe, features) in ebc.groups() {
            let tables: Vec<String> = tbe.config().tables.iter().map(|t| t.name.clone()).collect();
            groups.push(Group {
                tbe: Arc::new(Mutex::new(CudaTbe::from_trained(tbe, dev.clone())?)),
                features: features.to_vec(),
                sparse: Arc::new(Mutex::new(vec![None; tables.len()])),
                tables,
            });
        }
        let (keys, dims) = ebc.output_keys_and_dims();
        Ok(CudaEmbeddingBagCollection {
            groups,
            output_keys: keys.to_vec(),
            output_dims: dims.to_vec(),
            device: dev,
        })
    }

    /// The device the tables live on.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    /// The row-sparse gradient of `table` (a table without a fused optimizer) summed over the
    /// backward calls since the last [`zero_sparse_gradients`](Self::zero_sparse_gradients):
    /// its distinct rows, sorted, and their gradients. `None` before any backward reached it,
    /// or for a table that trains with a fused optimizer.
    pub fn sparse_gradient(&self, table: &str) -> Result<Option<SparseTableGrad>> {
        for g in &self.groups {
            if let Some(t) = g.tables.iter().position(|n| n == table) {
                return Ok(g.sparse.lock()[t].clone());
            }
        }
        Err(Error::invalid(OP, format!("no table `{table}`")))
    }

    /// Clears the gradients kept for [`sparse_gradient`](Self::sparse_gradient).
    pub fn zero_sparse_gradients(&self) {
        for g in &self.groups {
            g.sparse.lock().iter_mut().for_each(|s| *s = None);
        }
    }

    /// Output keys and the pooled width of each (as the source collection's).
    pub fn output_keys_and_dims(&self) -> (&[String], &[usize]) {
        (&self.output_keys, &self.output_dims)
    }

    /// Pooled embeddings of every feature on the device: keys in config order, values
    /// `[B, Σ dims]`, differentiable (the backward updates the tables). Per-sample weights of
    /// the KJT scale the rows; when they require grad, the backward computes their gradient
    /// on the device and hands it back to them (on the host, where the KJT lives).
    pub fn forward(&self, kjt: &KeyedJaggedTensor) -> Result<KeyedTensor> {
        let mut outputs: Vec<(&[String], Tensor)> = Vec::new();
        for g in &self.groups {
            let (ids, offsets, weights) =
                crate::embedding::tbe_input_from_kjt(OP, kjt, &g.features)?;
            let ids = read_ints(OP, "ids", &ids)?;
            let offsets = read_ints(OP, "offsets", &offsets)?;
            // The group's weights as a tensor (linked to the KJT's when they require grad).
            let weight_input = weights.clone().filter(|w| w.requires_grad());
            let weights = weights
                .map(|w| w.to_dtype(DType::F32)?.to_vec::<f32>())
                .transpose()?;
            let tbe = g.tbe.lock();
            let batch = tbe.check_host_lookup(&ids, &offsets, weights.as_deref())?;
            let d_ids = self.device.htod(&ids)?;
            let d_offsets = self.device.htod(&offsets)?;
            let d_weights = weights.map(|w| self.device.htod(&w)).transpose()?;
            let mut out = self.device.alloc::<f32>(batch * tbe.out_stride())?;
            tbe.forward(&d_ids, &d_offsets, d_weights.as_ref(), batch, &mut out)?;
            let values = crate::tensor::cuda::from_buffer_f32(out, &[batch, tbe.out_stride()])?;
            drop(tbe);
            let values = record_op_with_state(
                values,
                &weight_input.iter().collect::<Vec<_>>(),
                LookupBackward {
                    tbe: g.tbe.clone(),
                    sparse: g.sparse.clone(),
                    ids: d_ids,
                    offsets: d_offsets,
                    weights: d_weights,
                    weights_dtype: weight_input.as_ref().map(Tensor::dtype),
                    batch,
                },
            );
            outputs.push((&g.features, values));
        }
        crate::embedding::assemble_pooled(&self.output_keys, &self.output_dims, outputs)
    }

    /// Copies the device tables and their optimizer state back into `ebc` (the collection
    /// this one was made from), e.g. before a checkpoint or a CPU evaluation.
    pub fn copy_to(&self, ebc: &EmbeddingBagCollection) -> Result<()> {
        let host = ebc.groups();
        if host.len() != self.groups.len() {
            return Err(Error::invalid(
                OP,
                "the collection does not have this one's tables",
            ));
        }
        for ((tbe, features), g) in host.into_iter().zip(&self.groups) {
            if features != g.features.as_slice() {
                return Err(Error::invalid(
                    OP,
                    "the collection does not have this one's tables",
                ));
            }
            let gpu = g.tbe.lock();
            for t in 0..tbe.config().tables.len() {
                let (w, state) = gpu.table_state(t)?;
                tbe.set_table_weights(t, &w)?;
                for (i, m) in state.iter().enumerate() {
                    tbe.set_optimizer_state(i, t, m)?;
                }
            }
            tbe.set_step(gpu.step());
        }
        Ok(())
    }
}

/// Autograd node of one group's lookup: the fused update with the output's gradient.
struct LookupBackward {
    tbe: Arc<Mutex<CudaTbe>>,
    /// Where a table without a fused optimizer sums its row-sparse gradients.
    sparse: Arc<Mutex<Vec<Option<SparseTableGrad>>>>,
    ids: super::DeviceBuffer<i64>,
    offsets: super::DeviceBuffer<i64>,
    weights: Option<super::DeviceBuffer<f32>>,
    /// The dtype of the per-sample weights when they want a gradient.
    weights_dtype: Option<DType>,
    batch: usize,
}

impl BackwardOp for LookupBackward {
    fn name(&self) -> &'static str {
        "cuda_embedding_bag_collection"
    }

    fn backward(&self, grad_output: &Tensor) -> Result<Vec<Option<Gradient>>> {
        let grad = crate::tensor::cuda::contiguous(grad_output)?;
        let ptr = crate::tensor::cuda::f32_operand(OP, "the gradient", &grad, &grad)?;
        let len = grad.numel();
        let mut weights_grad = match (self.weights_dtype, &self.weights) {
            (Some(_), Some(w)) => Some(w.device().alloc::<f32>(w.len())?),
            _ => None,
        };
        let mut tbe = self.tbe.lock();
        if tbe.has_fused_optimizer() {
            // SAFETY: `ptr` addresses `len` f32 values of `grad`, alive until the call returns
            // (the launches are queued on the current stream, before `grad` can be freed).
            unsafe {
                tbe.backward_raw(
                    &self.ids,
                    &self.offsets,
                    self.weights.as_ref(),
                    ptr,
                    len,
                    self.batch,
                    weights_grad.as_mut(),
                )?;
            }
        } else {
            // SAFETY: as above; this call also waits for the device (it reads the rows back).
            let grads = unsafe {
                tbe.backward_sparse_raw(
                    &self.ids,
                    &self.offsets,
                    self.weights.as_ref(),
                    ptr,
                    len,
                    self.batch,
                    weights_grad.as_mut(),
                )?
            };
            let mut kept = self.sparse.lock();
            for (slot, g) in kept.iter_mut().zip(grads) {
                match slot {
                    Some(sum) => sum.accumulate(&g),
                    None => *slot = Some(g),
                }
            }
        }
        drop(tbe);
        match (weights_grad, self.weights_dtype) {
            (Some(g), Some(dtype)) => {
                // The KJT's weights live on the host: their gradient goes back there.
                let n = g.len();
                let host = Tensor::from_vec(g.to_host()?, &[n])?.to_dtype(dtype)?;
                Ok(vec![Some(Gradient::Dense(host))])
            }
            _ => Ok(Vec::new()),
        }
    }
}
