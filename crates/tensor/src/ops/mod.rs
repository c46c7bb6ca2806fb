//! CPU kernels. Each file is one family; every public op is a `Tensor` method.
//!
//! Kernels compute in f32 or f64 (chosen by the input's dtype); f16/bf16 tensors are
//! converted with `to_dtype` first. Large inputs are split across this thread's compute
//! threads (see [`crate::set_compute_threads`]).

/// Runs `$body` with `$T` bound to the Rust type of a compute dtype.
macro_rules! float_dispatch {
    ($op:expr, $dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F64 => {
                type $T = f64;
                $body
            }
            d => Err($crate::TensorError::UnsupportedDType {
                op: $op,
                dtype: d,
                hint: " (kernels compute in f32/f64: convert with to_dtype first)",
            }),
        }
    };
}

mod elementwise;
mod inplace;
mod matmul;
mod nn;
mod reduce;

pub use matmul::gemm_threads_for;
pub use nn::LayerNormSaved;
