//! Table-batched embedding bags (TBE), row formats, EmbeddingBagCollection/EmbeddingCollection.
//!
//! * [`TableBatchedEmbedding`]: many FP32 tables in one flat buffer, looked up by many features
//!   in one call with FBGEMM's input layout (`indices`, `offsets` of `F·B + 1` entries,
//!   feature-major), pooled [`PoolingMode::Sum`]/[`PoolingMode::Mean`] or not at all, with an
//!   optimizer ([`FusedOptimizer`]) fused into the backward.
//! * [`QuantizedTableBatchedEmbedding`]: the inference TBE over rows stored as any
//!   [`WeightType`] (FP32 … INT2, FP8), byte-compatible with FBGEMM.
//! * [`quantize`]: the row formats themselves.
//! * [`checkpoint`]: tables and optimizer state as safetensors, written atomically.
//!
//! * [`EmbeddingBagCollection`] / [`EmbeddingCollection`]: TorchRec's modules over the TBE
//!   (KJT in, [`KeyedTensor`](crate::sparse::KeyedTensor) / per-feature
//!   [`JaggedTensor`](crate::sparse::JaggedTensor) out), taking part in autograd.
//!
//! Semantics are FBGEMM's (checked against its golden vectors) except where FBGEMM's CPU build
//! is mathematically wrong; there embers does the right thing, checked against a float64
//! reference:
//! * MEAN pooling with per-sample weights: the forward is `Σ w_k·row_k / L`, so the backward
//!   keeps the `1/L` (row gradient `w_k/L · ∂out`, weight gradient `row_k·∂out / L`); FBGEMM's
//!   CPU backward drops it.
//! * A table shared by several features: the gradient is summed over all of them and the
//!   optimizer steps each touched row once; FBGEMM's CPU build steps once per feature (same
//!   result for SGD, different for the Adagrad variants).
//! * Weight decay ([`WeightDecay`]) is applied; FBGEMM's CPU build ignores it.
//!
//! Beyond FBGEMM's CPU build: any dim ≥ 1 (FBGEMM CPU needs multiples of 4 for training and an
//! even packed byte count for 4/2-bit rows), Adam, pooling NONE in training, OCP E4M3FN rows.

pub mod checkpoint;
mod collection;
mod config;
mod inference;
mod input;
pub mod optimizer;
pub mod quantize;
mod storage;
pub(crate) mod tbe;
pub(crate) use tbe::fill_init;

pub(crate) use collection::{check_bag_configs, check_configs};
pub use collection::{
    EmbeddingBagCollection, EmbeddingCollection, QuantizedEmbeddingBagCollection,
};
pub use config::{
    BoundsCheckMode, EmbeddingBagConfig, EmbeddingConfig, EmbeddingInit, PoolingMode, TableSpec,
    WeightType,
};
pub use inference::{OutputDType, QuantizedTableBatchedEmbedding};
pub use input::{IndexSlice, TbeInput};
pub use optimizer::{FusedOptimizer, StateShape, WeightDecay};
pub use storage::{RowBuffer, RowElement};
pub use tbe::cpu::backward::{BackwardOutput, SparseTableGrad};
pub use tbe::{
    planner_cache_stats, CacheConfig, CachePolicy, CacheSize, CacheStats, CacheTimes, Placement,
    TableBatchedEmbedding, TbeBatch, TbeConfig, TbeGradients, MAX_CACHE_STATS_BINS,
};
