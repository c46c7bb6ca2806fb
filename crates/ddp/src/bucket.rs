//! Buckets: which parameters' gradients share one flat buffer, and in what order.

use brigade_tensor::Tensor;

use crate::stream::InFlight;

/// Groups parameters into buckets, visiting them in `order` (PyTorch: reverse
/// registration order at first, then the observed ready order). A bucket is closed
/// once it holds at least its cap: `first_cap` bytes for bucket 0, `cap` for the rest
/// (so a parameter larger than the cap gets a bucket of its own).
pub fn assign_buckets(param_bytes: &[usize], order: &[usize], first_cap: usize, cap: usize) -> Vec<Vec<usize>> {
    let mut buckets = vec![];
    let mut current = vec![];
    let mut bytes = 0;
    for &p in order {
        current.push(p);
        bytes += param_bytes[p];
        let limit = if buckets.is_empty() { first_cap } else { cap };
        if bytes >= limit {
            buckets.push(std::mem::take(&mut current));
            bytes = 0;
        }
    }
    if !current.is_empty() {
        buckets.push(current);
    }
    buckets
}

/// What a bucket holds once its reduction landed.
#[derive(Debug, Clone)]
pub(crate) enum Held {
    /// Nothing reduced yet (before the first synchronized pass, or during one).
    Nothing,
    /// The full buffer holds the reduced gradients.
    Full,
    /// The full buffer holds this rank's reduced shard at `offset..offset + len`, zeros elsewhere.
    ShardInPlace { offset: usize, len: usize },
    /// Only this shard is kept; the full buffer is freed until a gradient of the bucket is final.
    Shard { tensor: Tensor, offset: usize },
}

/// One bucket: a flat buffer whose slices are its parameters' gradients (padded to the policy's
/// layout).
pub(crate) struct Bucket {
    /// Parameter registration indices, in the order their slices sit in `flat`.
    pub(crate) params: Vec<usize>,
    /// The flat buffer; each parameter's `.grad` is a view into it.
    pub(crate) flat: Tensor,
    /// Elements of `flat` that are gradients (the rest is padding).
    pub(crate) grad_numel: usize,
    /// Parameters not yet ready in the current synchronized backward.
    pub(crate) pending: usize,
    /// The bucket's reduction in flight (the bucket belongs to the policy meanwhile).
    pub(crate) work: Option<InFlight>,
    /// What the bucket holds once its reduction landed.
    pub(crate) held: Held,
}

impl Bucket {
    /// Bytes of the flat buffer.
    pub(crate) fn bytes(&self) -> usize {
        self.flat.numel() * self.flat.dtype().size_in_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::assign_buckets;

    #[test]
    fn first_bucket_is_small_and_each_bucket_closes_at_its_cap() {
        // sizes of params 0..5; reverse order 4,3,2,1,0
        let sizes = [100, 40, 40, 30, 10];
        let order = [4, 3, 2, 1, 0];
        // first cap 35: [4(10), 3(30)] closes at 40 >= 35; then cap 70: [2,1] = 80 closes; [0] rest
        assert_eq!(
            assign_buckets(&sizes, &order, 35, 70),
            vec![vec![4, 3], vec![2, 1], vec![0]]
        );
        // a huge cap: everything in one bucket after the first
        assert_eq!(
            assign_buckets(&sizes, &order, 1, 1 << 30),
            vec![vec![4], vec![3, 2, 1, 0]]
        );
    }
}
