//! Configuration vocabulary shared by the TBE operators and the collection modules: pooling
//! modes, weight (row storage) types, bounds-check modes and table configs.

use crate::{Error, Result};

/// How the rows looked up for one bag are combined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PoolingMode {
    /// `Σ w_k · row_k` over the bag.
    Sum,
    /// `Σ w_k · row_k / L` (L = bag length); an empty bag gives zeros.
    Mean,
    /// No pooling: one output row per id (`[N, D]`), as sequence models need.
    None,
}

impl PoolingMode {
    /// FBGEMM's name of the mode (`SUM`, `MEAN`, `NONE`).
    pub fn fbgemm_name(self) -> &'static str {
        match self {
            PoolingMode::Sum => "SUM",
            PoolingMode::Mean => "MEAN",
            PoolingMode::None => "NONE",
        }
    }

    /// Parses FBGEMM's name (case-insensitive).
    pub fn from_fbgemm_name(name: &str) -> Result<PoolingMode> {
        match name.to_ascii_uppercase().as_str() {
            "SUM" => Ok(PoolingMode::Sum),
            "MEAN" => Ok(PoolingMode::Mean),
            "NONE" => Ok(PoolingMode::None),
            _ => Err(Error::invalid(
                "PoolingMode",
                format!("unknown pooling mode `{name}` (expected SUM, MEAN or NONE)"),
            )),
        }
    }
}

/// How the rows of a table are stored. The byte layout of each type is FBGEMM's (see
/// [`super::quantize`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightType {
    /// IEEE f32, `4·D` bytes.
    Fp32,
    /// IEEE half, `2·D` bytes.
    Fp16,
    /// bfloat16, `2·D` bytes.
    Bf16,
    /// FBGEMM's HFP8 (1 sign, 4 exponent, 3 mantissa bits, exponent bias 7, saturating at ±240,
    /// no inf/NaN), `D` bytes, no scale.
    Fp8,
    /// OCP FP8 E4M3FN (exponent bias 7, ±448 max, `0x7f`/`0xff` are NaN), `D` bytes, no scale.
    Fp8E4m3fn,
    /// `[fp16 scale][fp16 bias][D × u8 code]`.
    Int8,
    /// `[fp16 scale][fp16 bias][⌈D/2⌉ bytes]`, element `2j` in the low nibble.
    Int4,
    /// `[fp16 scale][fp16 bias][⌈D/4⌉ bytes]`, element `4j+k` at bits `2k..2k+1`.
    Int2,
}

impl WeightType {
    /// Every weight type, in FBGEMM's order of decreasing precision.
    pub const ALL: [WeightType; 8] = [
        WeightType::Fp32,
        WeightType::Fp16,
        WeightType::Bf16,
        WeightType::Fp8,
        WeightType::Fp8E4m3fn,
        WeightType::Int8,
        WeightType::Int4,
        WeightType::Int2,
    ];

    /// Bytes one row of `dim` elements takes (FBGEMM's CPU layout, no row padding).
    /// Saturates at `usize::MAX` for a dim no row of which fits memory (operators check
    /// their sizes with [`checked_row_bytes`](Self::checked_row_bytes)).
    pub fn row_bytes(self, dim: usize) -> usize {
        self.checked_row_bytes(dim).unwrap_or(usize::MAX)
    }

    /// [`row_bytes`](Self::row_bytes), or `None` where it does not fit a `usize`.
    pub fn checked_row_bytes(self, dim: usize) -> Option<usize> {
        match self {
            WeightType::Fp32 => dim.checked_mul(4),
            WeightType::Fp16 | WeightType::Bf16 => dim.checked_mul(2),
            WeightType::Fp8 | WeightType::Fp8E4m3fn => Some(dim),
            WeightType::Int8 => dim.checked_add(4),
            WeightType::Int4 => dim.div_ceil(2).checked_add(4),
            WeightType::Int2 => dim.div_ceil(4).checked_add(4),
        }
    }

    /// FBGEMM's `SparseType` name (`FP32`, `INT4`, ...; the OCP FP8 is `FP8_E4M3FN`).
    pub fn fbgemm_name(self) -> &'static str {
        match self {
            WeightType::Fp32 => "FP32",
            WeightType::Fp16 => "FP16",
            WeightType::Bf16 => "BF16",
            WeightType::Fp8 => "FP8",
            WeightType::Fp8E4m3fn => "FP8_E4M3FN",
            WeightType::Int8 => "INT8",
            WeightType::Int4 => "INT4",
            WeightType::Int2 => "INT2",
        }
    }

    /// Parses the name written by [`WeightType::fbgemm_name`] (case-insensitive).
    pub fn from_fbgemm_name(name: &str) -> Result<WeightType> {
        let upper = name.to_ascii_uppercase();
        WeightType::ALL
            .into_iter()
            .find(|t| t.fbgemm_name() == upper)
            .ok_or_else(|| {
                Error::invalid(
                    "WeightType",
                    format!("unknown weight type `{name}` (expected one of FP32, FP16, BF16, FP8, FP8_E4M3FN, INT8, INT4, INT2)"),
                )
            })
    }
}

/// What to do with an id outside its table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum BoundsCheckMode {
    /// Return an error naming the feature, table, bag, position and id (the default).
    #[default]
    Error,
    /// Skip the id as if it were absent from its bag (it does not count towards a MEAN bag's
    /// length), count it in the operator's warning counter and print one warning. With
    /// pooling NONE, where each id has its own output row, an id out of range is an error as
    /// in [`Error`](Self::Error) (skipping it would shift every row after it).
    WarnAndSkip,
}

/// How a new FP32 table is filled.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum EmbeddingInit {
    /// U(−1/√rows, 1/√rows): TorchRec's default for embedding tables.
    TorchRecDefault,
    /// U(low, high).
    Uniform {
        /// Lower bound.
        low: f32,
        /// Upper bound.
        high: f32,
    },
    /// N(0, std²).
    Normal {
        /// Standard deviation.
        std: f32,
    },
    /// Every element equal to `value`.
    Constant {
        /// The value.
        value: f32,
    },
}

/// One pooled embedding table and the features that look it up (TorchRec's
/// `EmbeddingBagConfig`).
#[derive(Clone, Debug, PartialEq)]
pub struct EmbeddingBagConfig {
    /// Table name (unique within a collection).
    pub name: String,
    /// Number of rows.
    pub num_embeddings: usize,
    /// Row width (any value ≥ 1).
    pub embedding_dim: usize,
    /// Features looked up in this table; several features may share it.
    pub feature_names: Vec<String>,
    /// How each bag is pooled (`Sum` or `Mean`).
    pub pooling: PoolingMode,
    /// How the rows are stored.
    pub weight_type: WeightType,
    /// How the table is initialised.
    pub init: EmbeddingInit,
}

impl EmbeddingBagConfig {
    /// A sum-pooled FP32 table with TorchRec's default initialisation.
    pub fn new(
        name: impl Into<String>,
        num_embeddings: usize,
        embedding_dim: usize,
        feature_names: &[&str],
    ) -> Self {
        EmbeddingBagConfig {
            name: name.into(),
            num_embeddings,
            embedding_dim,
            feature_names: feature_names.iter().map(|s| s.to_string()).collect(),
            pooling: PoolingMode::Sum,
            weight_type: WeightType::Fp32,
            init: EmbeddingInit::TorchRecDefault,
        }
    }

    /// The same config with another pooling mode.
    pub fn with_pooling(mut self, pooling: PoolingMode) -> Self {
        self.pooling = pooling;
        self
    }

    /// The same config with another initialiser.
    pub fn with_init(mut self, init: EmbeddingInit) -> Self {
        self.init = init;
        self
    }

    /// The same config with another weight type.
    pub fn with_weight_type(mut self, weight_type: WeightType) -> Self {
        self.weight_type = weight_type;
        self
    }
}

/// One non-pooled embedding table (TorchRec's `EmbeddingConfig`): each id gives its own row.
#[derive(Clone, Debug, PartialEq)]
pub struct EmbeddingConfig {
    /// Table name (unique within a collection).
    pub name: String,
    /// Number of rows.
    pub num_embeddings: usize,
    /// Row width (any value ≥ 1; equal across the tables of one collection).
    pub embedding_dim: usize,
    /// Features looked up in this table.
    pub feature_names: Vec<String>,
    /// How the rows are stored.
    pub weight_type: WeightType,
    /// How the table is initialised.
    pub init: EmbeddingInit,
}

impl EmbeddingConfig {
    /// An FP32 table with TorchRec's default initialisation.
    pub fn new(
        name: impl Into<String>,
        num_embeddings: usize,
        embedding_dim: usize,
        feature_names: &[&str],
    ) -> Self {
        EmbeddingConfig {
            name: name.into(),
            num_embeddings,
            embedding_dim,
            feature_names: feature_names.iter().map(|s| s.to_string()).collect(),
            weight_type: WeightType::Fp32,
            init: EmbeddingInit::TorchRecDefault,
        }
    }

    /// The same config with another initialiser.
    pub fn with_init(mut self, init: EmbeddingInit) -> Self {
        self.init = init;
        self
    }
}

/// Shape of one table inside a TBE operator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableSpec {
    /// Name used in error messages and checkpoints.
    pub name: String,
    /// Number of rows.
    pub rows: usize,
    /// Row width.
    pub dim: usize,
}

impl TableSpec {
    /// A table of `rows × dim`.
    pub fn new(name: impl Into<String>, rows: usize, dim: usize) -> Self {
        TableSpec {
            name: name.into(),
            rows,
            dim,
        }
    }
}
