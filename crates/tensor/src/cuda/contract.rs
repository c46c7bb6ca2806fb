//! The CUDA backend behind the device contract of `crates/tensor/src/backend.rs` (written
//! on the device-seam branch): every method forwards to the launch wrappers of this
//! module. Compiled once both branches are merged (see `mod.rs`).

use std::sync::Arc;

use super::{CudaDevice, CudaStorage};
use crate::backend::{AdamWScalars, BackendDevice, BackendStorage, BinaryOp, ReduceOp, SgdScalars, UnaryOp};
use crate::storage::CpuStorage;
use crate::{DType, Device, Layout, Result};

impl BackendDevice for Arc<CudaDevice> {
    type Storage = CudaStorage;

    fn location(&self) -> Device {
        CudaDevice::location(self)
    }

    fn zeros(&self, dtype: DType, n: usize) -> Result<CudaStorage> {
        CudaStorage::zeros(self, dtype, n)
    }

    fn storage_from_cpu(&self, data: &CpuStorage) -> Result<CudaStorage> {
        CudaStorage::from_cpu(self, data)
    }
}

impl BackendStorage for CudaStorage {
    fn dtype(&self) -> DType {
        CudaStorage::dtype(self)
    }

    fn device(&self) -> Device {
        CudaStorage::device(self)
    }

    fn len(&self) -> usize {
        CudaStorage::len(self)
    }

    fn empty_like(&self) -> Self {
        CudaStorage::empty_like(self)
    }

    fn to_cpu(&self) -> Result<CpuStorage> {
        CudaStorage::to_cpu(self)
    }

    fn copy_strided(&self, layout: &Layout) -> Result<Self> {
        CudaStorage::copy_strided(self, layout)
    }

    fn to_dtype(&self, layout: &Layout, dtype: DType) -> Result<Self> {
        CudaStorage::to_dtype(self, layout, dtype)
    }

    fn unary(&self, layout: &Layout, op: UnaryOp) -> Result<Self> {
        let (name, p0, p1) = match op {
            UnaryOp::Neg => ("neg", 0.0, 0.0),
            UnaryOp::Exp => ("exp", 0.0, 0.0),
            UnaryOp::Ln => ("ln", 0.0, 0.0),
            UnaryOp::Sqrt => ("sqrt", 0.0, 0.0),
            UnaryOp::Relu => ("relu", 0.0, 0.0),
            UnaryOp::Gelu => ("gelu", 0.0, 0.0),
            UnaryOp::Sqr => ("sqr", 0.0, 0.0),
            UnaryOp::Affine { mul, add } => ("affine", mul, add),
            UnaryOp::Powf(p) => ("powf", p, 0.0),
        };
        self.unary_kernel(layout, name, p0, p1)
    }

    fn binary(&self, lhs: &Layout, rhs: &Self, rhs_layout: &Layout, op: BinaryOp) -> Result<Self> {
        let name = match op {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::ReluBackward => "relu_backward",
            BinaryOp::GeluBackward => "gelu_backward",
        };
        self.binary_kernel(lhs, rhs, rhs_layout, name)
    }

    fn reduce(&self, layout: &Layout, dims: &[usize], op: ReduceOp) -> Result<Self> {
        CudaStorage::reduce(self, layout, dims, matches!(op, ReduceOp::Max))
    }

    fn matmul(&self, lhs: &Layout, rhs: &Self, rhs_layout: &Layout) -> Result<Self> {
        CudaStorage::matmul(self, lhs, rhs, rhs_layout)
    }

    fn softmax_last(&self, layout: &Layout, log: bool) -> Result<Self> {
        CudaStorage::softmax_last(self, layout, log)
    }

    fn softmax_backward(&self, layout: &Layout, g: &Self, g_layout: &Layout, log: bool) -> Result<Self> {
        CudaStorage::softmax_backward(self, layout, g, g_layout, log)
    }

    fn layer_norm(
        &self,
        layout: &Layout,
        weight: (&Self, &Layout),
        bias: (&Self, &Layout),
        eps: f64,
    ) -> Result<(Self, Self, Self)> {
        CudaStorage::layer_norm(self, layout, weight, bias, eps)
    }

    fn layer_norm_backward(
        &self,
        layout: &Layout,
        weight: (&Self, &Layout),
        mean: (&Self, &Layout),
        rstd: (&Self, &Layout),
        gy: (&Self, &Layout),
    ) -> Result<(Self, Self, Self)> {
        CudaStorage::layer_norm_backward(self, layout, weight, mean, rstd, gy)
    }

    fn embedding(&self, layout: &Layout, ids: (&Self, &Layout)) -> Result<Self> {
        CudaStorage::embedding(self, layout, ids)
    }

    fn embedding_backward(&self, layout: &Layout, ids: (&Self, &Layout), vocab: usize) -> Result<Self> {
        CudaStorage::embedding_backward(self, layout, ids, vocab)
    }

    fn causal_fill(&self, layout: &Layout, value: f64) -> Result<Self> {
        CudaStorage::causal_fill(self, layout, value)
    }

    fn cross_entropy(&self, layout: &Layout, targets: (&Self, &Layout)) -> Result<(Self, Self)> {
        CudaStorage::cross_entropy(self, layout, targets)
    }

    fn cross_entropy_backward(&self, layout: &Layout, targets: (&Self, &Layout), g: f64) -> Result<Self> {
        CudaStorage::cross_entropy_backward(self, layout, targets, g)
    }

    fn fill(&mut self, layout: &Layout, v: f64) -> Result<()> {
        CudaStorage::fill(self, layout, v)
    }

    fn copy_from(&mut self, layout: &Layout, src: (&Self, &Layout)) -> Result<()> {
        CudaStorage::copy_from(self, layout, src)
    }

    fn add_scaled_assign(&mut self, layout: &Layout, src: (&Self, &Layout), scale: f64) -> Result<()> {
        CudaStorage::add_scaled_assign(self, layout, src, scale)
    }

    fn sgd_step(
        &mut self,
        layout: &Layout,
        grad: (&Self, &Layout),
        momentum_buffer: Option<(&mut Self, &Layout)>,
        s: &SgdScalars,
    ) -> Result<()> {
        CudaStorage::sgd_step(
            self,
            layout,
            grad,
            momentum_buffer,
            s.lr,
            s.momentum,
            s.weight_decay,
            s.is_first_step,
        )
    }

    fn adamw_step(
        &mut self,
        layout: &Layout,
        grad: (&Self, &Layout),
        m: (&mut Self, &Layout),
        v: (&mut Self, &Layout),
        s: &AdamWScalars,
    ) -> Result<()> {
        let scalars = [
            s.decay,
            s.beta1,
            s.one_minus_beta1,
            s.beta2,
            s.one_minus_beta2,
            s.step_size,
            s.bias_correction2_sqrt,
            s.eps,
        ];
        CudaStorage::adamw_step(self, layout, grad, m, v, scalars)
    }
}
