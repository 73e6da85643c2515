//! DLRM's dense half (TorchRec's `DenseArch`, `InteractionArch`, `InteractionDCNArch`,
//! `OverArch`): everything after the embedding lookup.
//!
//! Shapes follow TorchRec: dense features `[B, dense_in]` → `[B, D]`; pooled embeddings
//! `[B, F, D]`; the dot interaction concatenates the dense output with the strict upper
//! triangle of the `(F+1)×(F+1)` pairwise dot products, `[B, D + F(F+1)/2]`; the DCN variant
//! feeds `[B, (F+1)·D]` through a low-rank cross network; the over arch ends in one
//! un-activated linear layer producing logits.

use crate::embedding::EmbeddingBagCollection;
use crate::nn::{prefixed, Activation, Forward, Init, Linear, Mlp, Module};
use crate::sparse::KeyedJaggedTensor;
use crate::tensor::rng::Rng;
use crate::{DType, Device, Error, Result, Tensor};

/// The bottom MLP over dense features (ReLU after every layer, as TorchRec).
#[derive(Clone, Debug)]
pub struct DenseArch {
    mlp: Mlp,
}

impl DenseArch {
    /// `in_features → layer_sizes`, the last size being the embedding dim `D`.
    pub fn new(
        in_features: usize,
        layer_sizes: &[usize],
        dtype: DType,
        rng: &mut Rng,
    ) -> Result<Self> {
        Ok(DenseArch {
            mlp: Mlp::with_dtype(in_features, layer_sizes, Activation::Relu, dtype, rng)?,
        })
    }

    /// Output width (`D`).
    pub fn out_features(&self) -> usize {
        self.mlp.out_features()
    }

    /// Input width (dense features per sample).
    pub fn in_features(&self) -> usize {
        self.mlp.in_features()
    }
}

impl Module for DenseArch {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        prefixed("mlp", self.mlp.named_parameters())
    }
}

impl Forward for DenseArch {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.mlp.forward(x)
    }
}

/// Pairwise dot-product interaction of the dense output with every pooled embedding (the
/// fused [`dot_interaction`](super::interaction::dot_interaction) op).
#[derive(Clone, Debug)]
pub struct InteractionArch {
    num_sparse_features: usize,
}

impl InteractionArch {
    /// For `num_sparse_features` pooled embeddings (plus the dense one).
    pub fn new(num_sparse_features: usize) -> Self {
        InteractionArch {
            num_sparse_features,
        }
    }

    /// Output width for embedding dim `dim`: `D + F(F+1)/2`.
    pub fn out_features(&self, dim: usize) -> usize {
        let f = self.num_sparse_features;
        dim + f * (f + 1) / 2
    }

    /// `dense [B, D]`, `sparse [B, F, D]` → `[B, D + F(F+1)/2]`: the dense vector, then the
    /// strict upper triangle (row-major) of the `(F+1)×(F+1)` dot products of
    /// `[dense, sparse_0, …]`, as TorchRec's `InteractionArch`.
    pub fn forward(&self, dense: &Tensor, sparse: &Tensor) -> Result<Tensor> {
        check_inputs("InteractionArch", dense, sparse, self.num_sparse_features)?;
        super::interaction::dot_interaction(dense, sparse)
    }
}

fn check_inputs(
    op: &'static str,
    dense: &Tensor,
    sparse: &Tensor,
    features: usize,
) -> Result<(usize, usize)> {
    if dense.rank() != 2
        || sparse.rank() != 3
        || sparse.shape()[0] != dense.shape()[0]
        || sparse.shape()[2] != dense.shape()[1]
        || sparse.shape()[1] != features
    {
        return Err(Error::ShapeMismatch {
            op,
            lhs: dense.shape().to_vec(),
            rhs: sparse.shape().to_vec(),
            detail: format!("expected dense [B, D] and sparse [B, {features}, D]"),
        });
    }
    Ok((dense.shape()[0], dense.shape()[1]))
}

/// DCNv2's low-rank cross network: `x_{l+1} = x_0 ⊙ (W_l (V_l x_l) + b_l) + x_l`.
#[derive(Clone, Debug)]
pub struct LowRankCrossNet {
    /// Per layer: `V` `[rank, in]` (no bias) and `W` `[in, rank]` with bias `[in]`.
    layers: Vec<(Linear, Linear)>,
}

impl LowRankCrossNet {
    /// `num_layers` cross layers of width `in_features` and rank `rank` (Xavier-normal
    /// kernels, zero bias, as TorchRec).
    pub fn new(
        in_features: usize,
        num_layers: usize,
        rank: usize,
        dtype: DType,
        rng: &mut Rng,
    ) -> Result<Self> {
        if num_layers == 0 || rank == 0 || in_features == 0 {
            return Err(Error::invalid(
                "LowRankCrossNet::new",
                "layers, rank and width must be positive",
            ));
        }
        let layers = (0..num_layers)
            .map(|_| {
                let v = Linear::with_init(
                    in_features,
                    rank,
                    false,
                    Init::XavierNormal,
                    Init::Zeros,
                    dtype,
                    rng,
                )?;
                let w = Linear::with_init(
                    rank,
                    in_features,
                    true,
                    Init::XavierNormal,
                    Init::Zeros,
                    dtype,
                    rng,
                )?;
                Ok((v, w))
            })
            .collect::<Result<_>>()?;
        Ok(LowRankCrossNet { layers })
    }
}

impl Module for LowRankCrossNet {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.layers
            .iter()
            .enumerate()
            .flat_map(|(i, (v, w))| {
                let mut p = prefixed(&format!("layers.{i}.v"), v.named_parameters());
                p.extend(prefixed(&format!("layers.{i}.w"), w.named_parameters()));
                p
            })
            .collect()
    }
}

impl Forward for LowRankCrossNet {
    fn forward(&self, x0: &Tensor) -> Result<Tensor> {
        let mut x = x0.clone();
        for (v, w) in &self.layers {
            x = x0.mul(&w.forward(&v.forward(&x)?)?)?.add(&x)?;
        }
        Ok(x)
    }
}

/// The top MLP: ReLU layers, then one linear layer without activation (logits).
#[derive(Clone, Debug)]
pub struct OverArch {
    mlp: Mlp,
}

impl OverArch {
    /// `in_features → layer_sizes`; the last size is the number of logits (usually 1).
    pub fn new(
        in_features: usize,
        layer_sizes: &[usize],
        dtype: DType,
        rng: &mut Rng,
    ) -> Result<Self> {
        Ok(OverArch {
            mlp: Mlp::with_dtype(in_features, layer_sizes, Activation::Relu, dtype, rng)?
                .activate_last(false),
        })
    }
}

impl Module for OverArch {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        prefixed("mlp", self.mlp.named_parameters())
    }
}

impl Forward for OverArch {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.mlp.forward(x)
    }
}

/// How dense and sparse features meet.
#[derive(Clone, Debug)]
pub enum Interaction {
    /// DLRM's pairwise dot products.
    Dot(InteractionArch),
    /// DLRM-DCN: a low-rank cross network over the concatenated features.
    Dcn(LowRankCrossNet),
}

/// DLRM after the embedding lookup: dense arch, interaction, over arch.
#[derive(Clone, Debug)]
pub struct DlrmDense {
    /// Bottom MLP.
    pub dense_arch: DenseArch,
    /// Feature interaction.
    pub interaction: Interaction,
    /// Top MLP.
    pub over_arch: OverArch,
    num_sparse_features: usize,
}

impl DlrmDense {
    /// DLRM with the dot interaction: `dense_in → dense_sizes` (last = `D`), `F` sparse
    /// features of dim `D`, over arch `over_sizes` (last = logits).
    pub fn dot(
        dense_in: usize,
        dense_sizes: &[usize],
        num_sparse_features: usize,
        over_sizes: &[usize],
        dtype: DType,
        rng: &mut Rng,
    ) -> Result<Self> {
        let dense_arch = DenseArch::new(dense_in, dense_sizes, dtype, rng)?;
        let inter = InteractionArch::new(num_sparse_features);
        let over_in = inter.out_features(dense_arch.out_features());
        let over_arch = OverArch::new(over_in, over_sizes, dtype, rng)?;
        Ok(DlrmDense {
            dense_arch,
            interaction: Interaction::Dot(inter),
            over_arch,
            num_sparse_features,
        })
    }

    /// DLRM-DCN: the cross network (`cross_layers` layers of rank `rank`) replaces the dot
    /// interaction; the over arch sees `(F+1)·D` features.
    #[allow(clippy::too_many_arguments)]
    pub fn dcn(
        dense_in: usize,
        dense_sizes: &[usize],
        num_sparse_features: usize,
        over_sizes: &[usize],
        cross_layers: usize,
        rank: usize,
        dtype: DType,
        rng: &mut Rng,
    ) -> Result<Self> {
        let dense_arch = DenseArch::new(dense_in, dense_sizes, dtype, rng)?;
        let width = (num_sparse_features + 1) * dense_arch.out_features();
        let cross = LowRankCrossNet::new(width, cross_layers, rank, dtype, rng)?;
        let over_arch = OverArch::new(width, over_sizes, dtype, rng)?;
        Ok(DlrmDense {
            dense_arch,
            interaction: Interaction::Dcn(cross),
            over_arch,
            num_sparse_features,
        })
    }

    /// `dense [B, dense_in]`, pooled embeddings `[B, F, D]` → logits `[B, over_sizes.last]`.
    pub fn forward(&self, dense: &Tensor, sparse: &Tensor) -> Result<Tensor> {
        let d = self.dense_arch.forward(dense)?;
        let features = match &self.interaction {
            Interaction::Dot(arch) => arch.forward(&d, sparse)?,
            Interaction::Dcn(cross) => {
                let (b, dim) =
                    check_inputs("InteractionDCNArch", &d, sparse, self.num_sparse_features)?;
                let flat = sparse.reshape(&[b, self.num_sparse_features * dim])?;
                cross.forward(&Tensor::cat(&[&d, &flat], 1)?)?
            }
        };
        self.over_arch.forward(&features)
    }
}

impl Module for DlrmDense {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut p = prefixed("dense_arch", self.dense_arch.named_parameters());
        if let Interaction::Dcn(cross) = &self.interaction {
            p.extend(prefixed("inter_arch.crossnet", cross.named_parameters()));
        }
        p.extend(prefixed("over_arch", self.over_arch.named_parameters()));
        p
    }
}

/// The whole DLRM (TorchRec's `DLRM` / `DLRM_DCN`): an [`EmbeddingBagCollection`] whose pooled
/// outputs (one per feature, all of dim `D`) feed [`DlrmDense`]. Dense parameters are trained by
/// a dense optimizer; the tables by the optimizer fused into the embedding-bag backward.
#[derive(Clone, Debug)]
pub struct Dlrm {
    /// The embedding tables.
    pub sparse_arch: EmbeddingBagCollection,
    /// Everything after the lookup.
    pub dense: DlrmDense,
}

impl Dlrm {
    /// Joins tables and dense half; every feature's pooled width must be the dense arch's
    /// output width `D`, and the feature count must match.
    pub fn new(sparse_arch: EmbeddingBagCollection, dense: DlrmDense) -> Result<Self> {
        let d = dense.dense_arch.out_features();
        let (_, dims) = sparse_arch.output_keys_and_dims();
        if dims.len() != dense.num_sparse_features || dims.iter().any(|&x| x != d) {
            return Err(Error::invalid(
                "Dlrm::new",
                format!(
                    "the dense half expects {} features of dim {d}, the tables give dims {dims:?}",
                    dense.num_sparse_features
                ),
            ));
        }
        Ok(Dlrm { sparse_arch, dense })
    }

    /// `dense_features [B, dense_in]`, `sparse_features` (a KJT with the tables' features) →
    /// logits `[B, tasks]`.
    pub fn forward(
        &self,
        dense_features: &Tensor,
        sparse_features: &KeyedJaggedTensor,
    ) -> Result<Tensor> {
        let pooled = self.sparse_arch.forward(sparse_features)?;
        self.forward_pooled(dense_features, pooled.values())
    }

    /// The device the model computes on (its tables' and dense half's).
    pub fn device(&self) -> Device {
        self.sparse_arch.device()
    }

    /// Moves the model to `device`: the tables (with their optimizer state) and the dense
    /// parameters, in place (build the dense optimizer after this). On an error nothing moved.
    pub fn to_device(&mut self, device: Device) -> Result<()> {
        // The tables may be there already (a cache built on the device) while the dense half
        // is not: each half moves unless it is there.
        let from = self.device();
        if device != from {
            self.sparse_arch.to_device(device)?;
        }
        if let Err(e) = self.dense.to_device(device) {
            self.sparse_arch.to_device(from)?;
            return Err(e);
        }
        Ok(())
    }

    /// The dense half on already pooled embeddings `[B, F·D]` (e.g. from a quantized copy of
    /// the tables, [`EmbeddingBagCollection::quantize`]) → logits `[B, tasks]`.
    pub fn forward_pooled(&self, dense_features: &Tensor, pooled: &Tensor) -> Result<Tensor> {
        let b = dense_features.shape().first().copied().unwrap_or(0);
        let d = self.dense.dense_arch.out_features();
        let width = self.dense.num_sparse_features * d;
        // Checked before the reshape, which took any tensor of B·F·D elements (a feature-major
        // buffer, or one sample's row holding two).
        if dense_features.rank() != 2 || pooled.shape() != [b, width] {
            return Err(Error::ShapeMismatch {
                op: "Dlrm::forward_pooled",
                lhs: dense_features.shape().to_vec(),
                rhs: pooled.shape().to_vec(),
                detail: format!(
                    "expected dense features [B, in] and pooled embeddings [B, {width}]"
                ),
            });
        }
        let device = self.device();
        let embedded =
            (pooled.to_device(device)?).reshape(&[b, self.dense.num_sparse_features, d])?;
        self.dense
            .forward(&dense_features.to_device(device)?, &embedded)
    }
}
