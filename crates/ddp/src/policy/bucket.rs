//! What a policy is handed and what it hands back: a ready bucket, its reduction, the layout
//! it asks for, and the per-bucket state kit that enforces the rebuild rule.

use std::collections::HashMap;

use brigade_tensor::{DType, Tensor};

use crate::collectives::TensorWork;

/// Where one parameter's gradient sits in its bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketParam {
    /// Registration index of the parameter (stable across bucket rebuilds: key state by it).
    pub index: usize,
    /// Its name (`layers.0.weight`).
    pub name: String,
    /// First element of its gradient in the bucket's buffer.
    pub offset: usize,
    /// Its shape (the gradient has `shape.iter().product()` elements).
    pub shape: Vec<usize>,
}

impl BucketParam {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// True for a zero-size parameter.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Tag of bucket `i`'s collectives (shows up in traces and errors).
pub fn bucket_tag(i: usize) -> String {
    format!("bucket{i}")
}

/// One full bucket handed to [`crate::ReducerPolicy::reduce`] (PyTorch's `GradBucket`).
#[derive(Debug, Clone)]
pub struct PolicyBucket {
    /// The bucket's index: its place in the launch order, the same on every rank.
    pub index: usize,
    /// The bucket's flat buffer on the parameters' device: this rank's gradients, **not**
    /// divided by the world size, then zeros up to the layout's padding. The gradients are
    /// views into it: from `reduce` until the end of backward the bucket belongs to the policy.
    /// Its dtype is the reduce dtype ([`BucketLayout::dtype`]; by default
    /// [`crate::policy::PolicyContext::reduce_dtype`]): f32 in an f32 run, bf16 or fp16 beside
    /// 16-bit parameters unless f32 was asked for. Under fp16's dynamic loss scaling it holds the
    /// scaled gradients, and an inf or a NaN in it is a skipped step, not an error (see
    /// [`crate::policy::StepContext::loss_scale`]).
    pub tensor: Tensor,
    /// The parameters in the buffer, in buffer order.
    pub params: Vec<BucketParam>,
    /// Elements that are gradients (the rest of `tensor` is padding).
    pub grad_numel: usize,
    /// Whether this is the last bucket of the backward pass (PyTorch's `is_last`).
    pub is_last: bool,
    /// The layout's generation: it changes whenever the buckets are rebuilt (see
    /// [`crate::ReducerPolicy::buckets_built`] and [`PerBucket`]).
    pub generation: u64,
}

impl PolicyBucket {
    /// The tag of this bucket's collectives (`bucket3`).
    pub fn tag(&self) -> String {
        bucket_tag(self.index)
    }
}

/// How a policy reduces a bucket: the future of what DDP puts back under the gradients.
pub enum Reduction {
    /// The bucket's new contents, normally the average over ranks: a tensor of the bucket's
    /// length and dtype (the bucket tensor itself when reduced in place; another tensor is moved
    /// under the gradient views without a copy when it spans its storage).
    Full(TensorWork<Tensor>),
    /// This rank's shard of the reduced bucket: elements `rank*n..(rank+1)*n` of the padded
    /// buffer, `n = len / world` (ZeRO). With `keep_full` the full buffer stays allocated (the
    /// shard written in place, the rest zeroed: this rank does not know it); without, it is
    /// freed after the collective and the parameters' gradients are dropped until the next
    /// backward makes one of them final (ZeRO-2).
    Shard {
        /// The shard's future.
        shard: TensorWork<Tensor>,
        /// Keep the full buffer allocated.
        keep_full: bool,
    },
}

/// The buckets a policy needs (asked once, when DDP is built).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketLayout {
    /// Each bucket's buffer is padded with zeros to a multiple of this many elements (1: none;
    /// ZeRO: the world size, for equal shards).
    pub pad_to: usize,
    /// The buffers' element type: the reduce dtype unless the policy asks for another
    /// ([`crate::ReducerPolicy::layout`]; f32 in an f32 run, bf16 or fp16 beside 16-bit
    /// parameters).
    pub dtype: DType,
    /// Whether DDP may regroup the buckets: rebuild them after the first iteration from the
    /// observed ready order, and under new caps (`set_bucket_caps`, the autotuner). `false` keeps
    /// the first layout for the whole run (ZeRO: its optimizer state is cut from the buckets).
    pub regroup: bool,
}

impl Default for BucketLayout {
    fn default() -> Self {
        BucketLayout {
            pad_to: 1,
            dtype: DType::F32,
            regroup: true,
        }
    }
}

/// Per-bucket state that cannot outlive its layout: the rule across bucket rebuilds, enforced.
/// A bucket index names different parameters once DDP has rebuilt its buckets (after the first
/// iteration, or under new caps), so state stored for bucket `i` of one layout is dropped, not
/// read, under the next ([`PolicyBucket::generation`]). State that must survive a rebuild is
/// keyed by parameter ([`BucketParam::index`]) instead, as PowerSGD's is.
#[derive(Debug, Clone)]
pub struct PerBucket<T> {
    generation: Option<u64>,
    state: HashMap<usize, T>,
}

impl<T> Default for PerBucket<T> {
    fn default() -> Self {
        PerBucket {
            generation: None,
            state: HashMap::new(),
        }
    }
}

impl<T> PerBucket<T> {
    /// No state.
    pub fn new() -> Self {
        Self::default()
    }

    /// Forgets everything stored under another generation than `bucket`'s.
    fn align(&mut self, bucket: &PolicyBucket) {
        if self.generation != Some(bucket.generation) {
            self.state.clear();
            self.generation = Some(bucket.generation);
        }
    }

    /// `bucket`'s state, if it was stored under the same layout.
    pub fn get(&mut self, bucket: &PolicyBucket) -> Option<&mut T> {
        self.align(bucket);
        self.state.get_mut(&bucket.index)
    }

    /// Stores `bucket`'s state (dropping what other layouts left).
    pub fn insert(&mut self, bucket: &PolicyBucket, value: T) {
        self.align(bucket);
        self.state.insert(bucket.index, value);
    }

    /// `bucket`'s state, made by `make` if there is none under this layout.
    pub fn get_or_insert_with(&mut self, bucket: &PolicyBucket, make: impl FnOnce() -> T) -> &mut T {
        self.align(bucket);
        self.state.entry(bucket.index).or_insert_with(make)
    }

    /// Number of buckets with state.
    pub fn len(&self) -> usize {
        self.state.len()
    }

    /// True when no bucket has state.
    pub fn is_empty(&self) -> bool {
        self.state.is_empty()
    }

    /// Every bucket's state, in no particular order.
    pub fn values(&self) -> impl Iterator<Item = &T> {
        self.state.values()
    }
}
