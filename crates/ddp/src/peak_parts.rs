//! The parts a rank's memory peak is split into: what each tensor storage is for
//! ([`MemoryPart`], set on the thread that makes it) and the bytes of each part alive at the
//! peak's moment ([`PeakParts`]).

use brigade_tensor::{MemoryMeter, PartGuard, MEMORY_PARTS};
use serde::{Deserialize, Serialize};

/// What a rank's tensor storages are for, as its [`MemoryMeter`] splits the peak: the part set
/// on the thread that makes a storage ([`MemoryPart::enter`]; the innermost wins, so a unit
/// gathered inside the forward counts as gathered, not as activations). What a collective makes
/// on the comm stream's thread counts to the part that issued it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryPart {
    /// Made outside every other part (batches, the data, DDP's own bookkeeping).
    Other = 0,
    /// The model's parameters as built, and ZeRO-3's shards of them (cut when the optimizer is
    /// built).
    Parameters = 1,
    /// ZeRO-3's units, gathered whole for their forward and backward.
    Gathered = 2,
    /// Full bucket buffers: the gradients as backward makes them final, until their reduction
    /// lands (under ZeRO-2 and 3, the units' gradients in flight).
    BucketGradients = 3,
    /// What a bucket's reduction makes: ZeRO's gradient shards, a policy's scratch.
    Reductions = 4,
    /// What the forward keeps for backward (activations, the loss's logits and softmax) and
    /// makes meanwhile.
    Activations = 5,
    /// Backward's own tensors: the activations' gradients, recomputed blocks.
    Backward = 6,
    /// The optimizer's state and its step's scratch (clipping included).
    Optimizer = 7,
}

impl MemoryPart {
    /// Charges the storages this thread makes to this part until the guard drops.
    pub fn enter(self) -> PartGuard {
        MemoryMeter::enter_part(self as usize)
    }
}

/// A peak split by [`MemoryPart`]: each part's bytes alive at the peak's moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct PeakParts {
    /// [`MemoryPart::Parameters`].
    pub parameters: usize,
    /// [`MemoryPart::Gathered`].
    pub gathered: usize,
    /// [`MemoryPart::BucketGradients`].
    pub bucket_gradients: usize,
    /// [`MemoryPart::Reductions`].
    pub reductions: usize,
    /// [`MemoryPart::Activations`].
    pub activations: usize,
    /// [`MemoryPart::Backward`].
    pub backward: usize,
    /// [`MemoryPart::Optimizer`].
    pub optimizer: usize,
    /// [`MemoryPart::Other`].
    pub other: usize,
}

impl PeakParts {
    /// The split a meter recorded at its peak ([`MemoryMeter::peak_parts`]).
    pub fn of(meter: &MemoryMeter) -> PeakParts {
        let p: [usize; MEMORY_PARTS] = meter.peak_parts();
        PeakParts {
            other: p[MemoryPart::Other as usize],
            parameters: p[MemoryPart::Parameters as usize],
            gathered: p[MemoryPart::Gathered as usize],
            bucket_gradients: p[MemoryPart::BucketGradients as usize],
            reductions: p[MemoryPart::Reductions as usize],
            activations: p[MemoryPart::Activations as usize],
            backward: p[MemoryPart::Backward as usize],
            optimizer: p[MemoryPart::Optimizer as usize],
        }
    }

    /// The parts' sum (the peak, but for storages made or freed on another thread at its
    /// moment).
    pub fn total(&self) -> usize {
        self.parameters
            + self.gathered
            + self.bucket_gradients
            + self.reductions
            + self.activations
            + self.backward
            + self.optimizer
            + self.other
    }
}
