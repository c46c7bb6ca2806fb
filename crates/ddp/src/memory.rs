//! Per-rank memory, measured from the storages alive on this rank: what the ZeRO paper counts,
//! and what a policy holds beside it.

use std::collections::HashMap;

use brigade_autograd::Optimizer;
use brigade_tensor::Tensor;
use serde::{Deserialize, Serialize};

use crate::peak_parts::PeakParts;
use crate::policy::HeldGrad;
use crate::policy::PolicyMemory;
use crate::reducer::Reducer;
use crate::Result;

/// Bytes this rank holds, measured from live allocations (each storage counted once, by its
/// whole length: a freed or lent buffer counts 0). For AdamW in f32 over Ψ parameters on N
/// ranks the ZeRO paper's accounting is, within the padding of the shards: plain DDP
/// `parameters 4Ψ + gradients 4Ψ + optimizer_state 8Ψ`; ZeRO-1 `optimizer_state 8Ψ/N`; ZeRO-2
/// also `gradients 4Ψ/N`; ZeRO-3 also `parameters 4Ψ/N` between steps (its shards; the
/// parameter tensors are freed), plus the units `gathered` at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct MemoryReport {
    /// The parameters' values.
    pub parameters: usize,
    /// Every gradient storage: full bucket buffers, the shards a policy keeps instead of them,
    /// and gradients outside any bucket.
    pub gradients: usize,
    /// The part of `gradients` held by full bucket buffers (0 under ZeRO-2 between steps).
    pub buckets: usize,
    /// The most bytes of full bucket buffers alive at once in the last synchronized backward
    /// (and the `no_sync` passes before it): every bucket under plain DDP, under ZeRO-2 and 3 the
    /// buckets being filled and those whose reduce-scatter has not landed yet (each is freed as
    /// its reduce-scatter lands).
    pub gradients_in_flight: usize,
    /// The optimizer's state ([`Optimizer::state_bytes`]).
    pub optimizer_state: usize,
    /// The policy's own state (PowerSGD's error feedback and factors).
    pub policy_state: usize,
    /// Communication scratch: the most bytes of collective buffers that the last optimizer step
    /// held at once beside the gradients (ZeRO's all-gathered parameters; 0 for in-place
    /// all-reduce).
    pub comm_scratch: usize,
    /// The most bytes of sharded parameters gathered whole at once (ZeRO-3's units, gathered
    /// for their forward and backward and freed after; 0 when parameters are not sharded).
    pub gathered: usize,
    /// Bytes of the tensors the graph held at the end of forward: what the storages alive on
    /// the rank's thread grew by across the forward of a microbatch (the most over the
    /// microbatches of the last step), measured by the tensor crate's
    /// [`brigade_tensor::MemoryMeter`]. Set by the trainer (0 from
    /// [`crate::DistributedDataParallel::rank_memory`] alone).
    pub activations: usize,
    /// The most bytes of tensor storage alive at once on the rank over the run's steps, the
    /// first to the last (parameters, gradients, buckets, optimizer state, activations,
    /// batches, scratch; what its collectives make on the comm stream's thread too), measured
    /// by the [`brigade_tensor::MemoryMeter`]. Set by the trainer (0 from `rank_memory`
    /// alone). Not part of [`MemoryReport::total`], which counts what stays between steps.
    pub peak: usize,
    /// What held `peak`'s bytes at its moment ([`crate::MemoryPart`]).
    pub peak_parts: PeakParts,
    /// The step whose peak is `peak` (`None`: no step ran).
    pub peak_step: Option<usize>,
    /// The most bytes alive at once during the last step (`peak` is the run's).
    pub last_step_peak: usize,
    /// The most bytes alive at once before the first step, while the model, its optimizer and
    /// DDP were built (what a run needs to start).
    pub construction_peak: usize,
    /// f32 master weights kept beside 16-bit parameters (mixed precision; 0 otherwise:
    /// an f32 run's master is the parameter itself).
    pub master_weights: usize,
}

impl MemoryReport {
    /// What stays between steps, each storage once: parameters, gradients, optimizer state,
    /// policy state, comm scratch, f32 master weights and the gathered units (not `activations`
    /// and `peak`, measured within the step).
    pub fn total(&self) -> usize {
        self.parameters
            + self.gradients
            + self.optimizer_state
            + self.policy_state
            + self.comm_scratch
            + self.master_weights
            + self.gathered
    }
}

fn live(t: &Tensor) -> (usize, usize) {
    (t.storage_id(), t.storage_numel() * t.dtype().size_in_bytes())
}

/// Measures `reducer`'s rank with optimizer `opt` and what the policy reports.
pub(crate) fn measure(reducer: &Reducer, opt: &dyn Optimizer, policy: PolicyMemory) -> Result<MemoryReport> {
    let parameters: HashMap<usize, usize> = reducer.params.iter().map(|p| live(&p.value())).collect();
    let st = reducer.lock();
    let buckets: HashMap<usize, usize> = st.buckets.iter().map(|b| live(&b.flat)).collect();
    let mut gradients = buckets.clone();
    gradients.extend(st.buckets.iter().filter_map(|b| match &b.held {
        Some(HeldGrad::Shard { tensor, .. }) => Some(live(tensor)),
        _ => None,
    }));
    gradients.extend(reducer.params.iter().filter_map(|p| p.grad()).map(|g| live(&g)));
    Ok(MemoryReport {
        parameters: parameters.values().sum::<usize>() + policy.parameter_bytes,
        gradients: gradients.values().sum(),
        buckets: buckets.values().sum(),
        gradients_in_flight: st.full_peak.max(st.full_bytes()),
        optimizer_state: opt.state_bytes()?,
        policy_state: policy.state_bytes,
        comm_scratch: policy.scratch_bytes,
        gathered: policy.gathered_bytes,
        activations: 0,
        peak: 0,
        peak_parts: PeakParts::default(),
        peak_step: None,
        last_step_peak: 0,
        construction_peak: 0,
        master_weights: opt.master_weight_bytes(),
    })
}
