//! Every CUDA C source of `kernels/` that embers launches, gathered from the ops that declare
//! them (each op names its own kernels beside its CUDA half), for the tools and tests that
//! compile or list them all.

use cudarc::nvrtc::Ptx;

use crate::cuda::KernelSource;
use crate::error::{Error, Result};

/// The kernel sources, one per file of `kernels/`.
pub static ALL: &[&KernelSource] = &[
    &crate::cuda::SORT,
    &crate::tensor::backend::cuda::ELEMENTWISE,
    &crate::tensor::backend::cuda::INDEX,
    &crate::optim::cuda::OPTIM,
    &crate::sparse::ops::dense::cuda::JAGGED,
    &crate::sparse::ops::bucketize::cuda::BUCKETIZE,
    &crate::embedding::tbe::cuda::forward::FORWARD,
    &crate::embedding::tbe::cuda::forward::FORWARD_QUANTIZED,
    &crate::embedding::tbe::cuda::backward::BACKWARD,
    &crate::models::interaction::cuda::INTERACTION,
    &crate::retrieval::cuda::TOPK,
];

/// The source of kernel file `file` (`tbe_forward.cu`, ...), or an error naming it.
pub fn find(file: &str) -> Result<&'static KernelSource> {
    ALL.iter()
        .copied()
        .find(|s| s.file == file)
        .ok_or_else(|| Error::invalid("kernels", format!("no kernel file `{file}`")))
}

/// Compiles kernel file `file` to PTX for `arch` ([`crate::cuda::compile_ptx`]).
pub fn compile_ptx(file: &str, arch: &'static str) -> Result<Ptx> {
    crate::cuda::compile_ptx(find(file)?, arch)
}
