//! Define-by-run reverse-mode autograd.
//!
//! Every differentiable op builds its output eagerly and, when an input requires grad, records a
//! [`Node`] holding a [`BackwardOp`]: the op's saved state plus the function that turns the
//! output's gradient into its inputs' gradients. `Tensor::backward` walks the recorded graph in
//! reverse topological order. Ops outside this module (jagged ops, embedding bags) plug in the
//! same way through [`record_op`].
//!
//! Gradients flowing into a leaf may be row-sparse ([`Gradient::RowSparse`]): an embedding-style
//! lookup never has to materialise a table-sized dense gradient.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::Tensor;
use crate::{DType, Error, Result};

/// The backward half of a differentiable op.
///
/// `backward` receives the gradient of the op's output (same shape and dtype as the output) and
/// returns one entry per input given to [`record_op`], in the same order: `None` where that input
/// needs no gradient. It runs with gradient recording disabled, so it may freely use tensor ops.
/// Tensors it reads that a caller could write in place (its inputs, its output) are best kept
/// as [`SavedTensor`]s, which refuse values changed since the forward.
pub trait BackwardOp: Send + Sync {
    /// Op name used in error messages.
    fn name(&self) -> &'static str;
    /// Computes the inputs' gradients from the output's gradient.
    fn backward(&self, grad_output: &Tensor) -> Result<Vec<Option<Gradient>>>;
}

/// A gradient: dense, or a set of rows of a 2-D (or higher) tensor.
#[derive(Clone, Debug)]
pub enum Gradient {
    /// Same shape as the tensor it belongs to.
    Dense(Tensor),
    /// Gradient of a few rows of a tensor with `num_rows` rows.
    RowSparse(RowSparseGrad),
}

/// Row-sparse gradient: `values[i]` is the gradient of row `rows[i]`. Rows may repeat until
/// [`RowSparseGrad::coalesce`] sums them.
#[derive(Clone, Debug)]
pub struct RowSparseGrad {
    /// Row index of each entry of `values`.
    pub rows: Vec<i64>,
    /// `[rows.len(), ...row shape]` gradient values.
    pub values: Tensor,
    /// Number of rows of the full tensor.
    pub num_rows: usize,
}

impl RowSparseGrad {
    /// Shape of the dense tensor this gradient belongs to (`[num_rows]` for values of no
    /// dimension, which no tensor with rows holds: the backward's shape check refuses it).
    pub fn dense_shape(&self) -> Vec<usize> {
        let mut s = self.values.shape().to_vec();
        match s.first_mut() {
            Some(rows) => *rows = self.num_rows,
            None => s.push(self.num_rows),
        }
        s
    }

    /// Materialises the dense gradient (zeros outside the touched rows).
    pub fn to_dense(&self) -> Result<Tensor> {
        let zeros = Tensor::try_zeros(
            &self.dense_shape(),
            self.values.dtype(),
            self.values.device(),
        )?;
        zeros.index_add_rows(&self.rows, &self.values)
    }

    /// Sums duplicate rows; the result has sorted unique rows (deterministic order).
    pub fn coalesce(&self) -> Result<RowSparseGrad> {
        if self.values.shape().first() != Some(&self.rows.len()) {
            return Err(Error::invalid(
                "RowSparseGrad::coalesce",
                format!(
                    "{} rows, values of shape {:?}: one row of values per row",
                    self.rows.len(),
                    self.values.shape()
                ),
            ));
        }
        let mut unique: Vec<i64> = self.rows.clone();
        unique.sort_unstable();
        unique.dedup();
        if unique.len() == self.rows.len() && self.rows.windows(2).all(|w| w[0] < w[1]) {
            return Ok(self.clone());
        }
        let position: HashMap<i64, i64> = unique
            .iter()
            .enumerate()
            .map(|(i, &r)| (r, i as i64))
            .collect();
        let target: Vec<i64> = self.rows.iter().map(|r| position[r]).collect();
        let mut shape = self.values.shape().to_vec();
        shape[0] = unique.len();
        let values = Tensor::try_zeros(&shape, self.values.dtype(), self.values.device())?
            .index_add_rows(&target, &self.values)?;
        Ok(RowSparseGrad {
            rows: unique,
            values,
            num_rows: self.num_rows,
        })
    }
}

impl Gradient {
    /// The dense form of this gradient.
    pub fn to_dense(&self) -> Result<Tensor> {
        match self {
            Gradient::Dense(t) => Ok(t.clone()),
            Gradient::RowSparse(s) => s.to_dense(),
        }
    }

    /// Shape of the tensor this gradient belongs to.
    pub fn shape(&self) -> Vec<usize> {
        match self {
            Gradient::Dense(t) => t.shape().to_vec(),
            Gradient::RowSparse(s) => s.dense_shape(),
        }
    }

    fn dtype(&self) -> DType {
        match self {
            Gradient::Dense(t) => t.dtype(),
            Gradient::RowSparse(s) => s.values.dtype(),
        }
    }

    /// Sum of two gradients of the same tensor. Sparse + sparse stays sparse.
    pub fn accumulate(self, other: Gradient) -> Result<Gradient> {
        Ok(match (self, other) {
            (Gradient::Dense(a), Gradient::Dense(b)) => Gradient::Dense(a.add(&b)?),
            (Gradient::Dense(d), Gradient::RowSparse(s))
            | (Gradient::RowSparse(s), Gradient::Dense(d)) => {
                Gradient::Dense(d.index_add_rows(&s.rows, &s.values)?)
            }
            (Gradient::RowSparse(a), Gradient::RowSparse(b)) => {
                let mut rows = a.rows;
                rows.extend_from_slice(&b.rows);
                Gradient::RowSparse(RowSparseGrad {
                    rows,
                    values: Tensor::cat(&[&a.values, &b.values], 0)?,
                    num_rows: a.num_rows,
                })
            }
        })
    }
}

/// A tensor a backward needs (an input or output of its forward), with its version
/// ([`Tensor::version`]) when saved: [`get`](Self::get) refuses it once it has been written in
/// place since ([`Error::ModifiedInPlace`]), so a gradient is never computed from values the
/// forward did not see. Its shape, dtype and device stay readable, since no in-place write
/// changes them.
#[derive(Clone)]
pub struct SavedTensor {
    /// `None` when only the description was kept ([`SavedTensor::new_if`]).
    tensor: Option<Tensor>,
    version: u64,
    shape: Vec<usize>,
    dtype: DType,
    device: crate::Device,
}

impl SavedTensor {
    /// Saves `tensor` (a handle; nothing is copied) at its current version.
    pub fn new(tensor: &Tensor) -> SavedTensor {
        SavedTensor::new_if(true, tensor)
    }

    /// Saves `tensor` when the backward may read its values (`keep`), else only its shape,
    /// dtype and device: the values are not held alive for nothing (as PyTorch saves only
    /// what a wanted gradient reads), and a write to them is no concern of this backward.
    pub fn new_if(keep: bool, tensor: &Tensor) -> SavedTensor {
        SavedTensor {
            tensor: keep.then(|| tensor.clone()),
            version: tensor.version(),
            shape: tensor.shape().to_vec(),
            dtype: tensor.dtype(),
            device: tensor.device(),
        }
    }

    /// The saved tensor, for the backward of `op`; an error if it was written in place since
    /// it was saved, or if only its description was kept.
    pub fn get(&self, op: &'static str) -> Result<&Tensor> {
        let tensor = self.tensor.as_ref().ok_or_else(|| {
            Error::Backward(format!(
                "`{op}`'s forward kept only the shape {:?} of a tensor its backward reads",
                self.shape
            ))
        })?;
        let now = tensor.version();
        if now != self.version {
            return Err(Error::ModifiedInPlace {
                op,
                shape: self.shape.clone(),
                saved: self.version,
                now,
            });
        }
        Ok(tensor)
    }

    /// The saved tensor's shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The saved tensor's dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The saved tensor's device.
    pub fn device(&self) -> crate::Device {
        self.device
    }
}

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// True unless inside [`no_grad`] (on this thread).
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// Disables gradient recording on this thread until dropped.
pub struct NoGradGuard {
    previous: bool,
}

impl NoGradGuard {
    /// Disables recording; the previous state comes back on drop.
    #[allow(clippy::new_without_default)]
    pub fn new() -> Self {
        let previous = GRAD_ENABLED.with(|g| g.replace(false));
        NoGradGuard { previous }
    }
}

impl Drop for NoGradGuard {
    fn drop(&mut self) {
        GRAD_ENABLED.with(|g| g.set(self.previous));
    }
}

/// Runs `f` without recording any autograd graph (evaluation, optimizer updates).
pub fn no_grad<R>(f: impl FnOnce() -> R) -> R {
    let _guard = NoGradGuard::new();
    f()
}

/// Runs `f` with recording on or off on this thread, restoring the mode after.
pub(crate) fn with_grad_enabled<R>(on: bool, f: impl FnOnce() -> R) -> R {
    let _guard = NoGradGuard {
        previous: GRAD_ENABLED.with(|g| g.replace(on)),
    };
    f()
}

enum EdgeTarget {
    Node(Arc<Node>),
    Leaf(Tensor),
}

struct Edge {
    target: EdgeTarget,
    shape: Vec<usize>,
    dtype: DType,
}

/// A recorded op in the graph: its backward function and where its inputs' gradients go.
pub struct Node {
    id: usize,
    name: &'static str,
    op: Mutex<Option<Box<dyn BackwardOp>>>,
    edges: Vec<Option<Edge>>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Node({} #{})", self.name, self.id)
    }
}

impl Node {
    /// Name of the op that created this node.
    pub fn name(&self) -> &'static str {
        self.name
    }
}

static NEXT_NODE_ID: AtomicUsize = AtomicUsize::new(0);

fn edge_for(input: &Tensor) -> Option<Edge> {
    let target = match input.grad_fn() {
        Some(node) => EdgeTarget::Node(node.clone()),
        None if input.requires_grad() => EdgeTarget::Leaf(input.clone()),
        None => return None,
    };
    Some(Edge {
        target,
        shape: input.shape().to_vec(),
        dtype: input.dtype(),
    })
}

/// Attaches `op` as the backward of `output` if gradient recording is on and any of `inputs`
/// requires grad; otherwise returns `output` unchanged. This is how every differentiable op,
/// inside embers or outside it, joins the graph.
pub fn record_op(output: Tensor, inputs: &[&Tensor], op: impl BackwardOp + 'static) -> Tensor {
    if !is_grad_enabled() || !inputs.iter().any(|t| t.requires_grad()) {
        return output;
    }
    attach(output, inputs, Box::new(op))
}

/// Like [`record_op`], but attaches the node whenever recording is on, even if no input requires
/// grad. For ops whose parameters live outside the tensor graph and are updated by the backward
/// itself (an embedding bag with a fused optimizer).
pub fn record_op_with_state(
    output: Tensor,
    inputs: &[&Tensor],
    op: impl BackwardOp + 'static,
) -> Tensor {
    if !is_grad_enabled() {
        return output;
    }
    attach(output, inputs, Box::new(op))
}

fn attach(output: Tensor, inputs: &[&Tensor], op: Box<dyn BackwardOp>) -> Tensor {
    let node = Arc::new(Node {
        id: NEXT_NODE_ID.fetch_add(1, Ordering::Relaxed),
        name: op.name(),
        op: Mutex::new(Some(op)),
        edges: inputs.iter().map(|t| edge_for(t)).collect(),
    });
    output.with_grad_fn(node)
}

/// Nodes reachable from `root`, each before all of the nodes it feeds gradients into.
fn topological_order(root: &Arc<Node>) -> Vec<Arc<Node>> {
    let mut visited = std::collections::HashSet::new();
    let mut post_order = Vec::new();
    // (node, next edge to visit)
    let mut stack: Vec<(Arc<Node>, usize)> = vec![(root.clone(), 0)];
    visited.insert(root.id);
    while let Some((node, next)) = stack.pop() {
        let child = node.edges[next..]
            .iter()
            .enumerate()
            .find_map(|(i, e)| match e {
                Some(Edge {
                    target: EdgeTarget::Node(n),
                    ..
                }) if !visited.contains(&n.id) => Some((next + i, n.clone())),
                _ => None,
            });
        match child {
            Some((i, n)) => {
                visited.insert(n.id);
                stack.push((node, i + 1));
                stack.push((n, 0));
            }
            None => post_order.push(node),
        }
    }
    post_order.reverse();
    post_order
}

fn check_gradient(node: &Node, edge: &Edge, grad: &Gradient) -> Result<()> {
    if grad.shape() != edge.shape || grad.dtype() != edge.dtype {
        return Err(Error::Backward(format!(
            "`{}` returned a gradient of shape {:?} ({:?}) for an input of shape {:?} ({:?})",
            node.name,
            grad.shape(),
            grad.dtype(),
            edge.shape,
            edge.dtype
        )));
    }
    if let Gradient::RowSparse(s) = grad {
        let entries = s.values.shape().first().copied().unwrap_or(0);
        if s.rows.len() != entries {
            return Err(Error::Backward(format!(
                "`{}` returned a row-sparse gradient of {} row numbers for {entries} rows of values",
                node.name,
                s.rows.len()
            )));
        }
        if let Some(r) = s.rows.iter().find(|&&r| r < 0 || r as usize >= s.num_rows) {
            return Err(Error::Backward(format!(
                "`{}` returned a row-sparse gradient naming row {r} of an input of {} rows",
                node.name, s.num_rows
            )));
        }
    }
    Ok(())
}

/// Runs reverse-mode differentiation from `root` seeded with `grad`.
pub(crate) fn run_backward(root: &Tensor, grad: Tensor, retain_graph: bool) -> Result<()> {
    if grad.shape() != root.shape() {
        return Err(Error::Backward(format!(
            "the seed gradient has shape {:?} but the tensor has shape {:?}",
            grad.shape(),
            root.shape()
        )));
    }
    let _no_grad = NoGradGuard::new();
    let Some(root_node) = root.grad_fn().cloned() else {
        if root.requires_grad() {
            return root.accumulate_grad(Gradient::Dense(grad));
        }
        return Err(Error::Backward(
            "the tensor does not require grad and has no grad_fn (did an input have \
             requires_grad set, and was recording on?)"
                .into(),
        ));
    };
    let mut pending: HashMap<usize, Gradient> = HashMap::new();
    pending.insert(root_node.id, Gradient::Dense(grad));
    for node in topological_order(&root_node) {
        let Some(grad) = pending.remove(&node.id) else {
            continue;
        };
        let grad = grad.to_dense()?;
        let input_grads = {
            let mut slot = node.op.lock();
            if retain_graph {
                let op = slot
                    .as_ref()
                    .ok_or(Error::BackwardTwice { op: node.name })?;
                op.backward(&grad)?
            } else {
                let op = slot.take().ok_or(Error::BackwardTwice { op: node.name })?;
                drop(slot);
                op.backward(&grad)?
            }
        };
        if input_grads.len() != node.edges.len() {
            return Err(Error::Backward(format!(
                "`{}` returned {} gradients for {} inputs",
                node.name,
                input_grads.len(),
                node.edges.len()
            )));
        }
        for (edge, g) in node.edges.iter().zip(input_grads) {
            let (Some(edge), Some(g)) = (edge, g) else {
                continue;
            };
            check_gradient(&node, edge, &g)?;
            match &edge.target {
                EdgeTarget::Node(n) => {
                    let merged = match pending.remove(&n.id) {
                        Some(prev) => prev.accumulate(g)?,
                        None => g,
                    };
                    pending.insert(n.id, merged);
                }
                EdgeTarget::Leaf(t) => t.accumulate_grad(g)?,
            }
        }
    }
    Ok(())
}
