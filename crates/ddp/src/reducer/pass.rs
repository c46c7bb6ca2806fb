//! One backward pass as the reducer lives it: set up when backward starts (which parameters
//! are in the graph, the buckets rebuilt in the order gradients arrived), each gradient
//! attached and counted as it becomes ready, finished or aborted when backward ends; and
//! the join pass of a rank without data, and the bucket caps changed between passes.

use std::time::Instant;

use brigade_autograd::{GradReady, GradSubscriber, SubscriberError};
use brigade_comm::{Communicator, EventKind};

use crate::bucket::Held;
use crate::stream::BucketStream;
use crate::{DdpError, Result};

use super::{group_params, is_lent, restore_zeros, PassTimes, Reducer, State};

impl Reducer {
    /// Regroups the buckets, in their current parameter order, under new caps (between passes
    /// only: no bucket may be in flight). Deterministic: ranks that call it with the same caps
    /// get the same buckets.
    pub(crate) fn set_caps(&self, st: &mut State, caps: (f64, f64)) -> Result<()> {
        if st.in_backward {
            return Err(DdpError::RebuildDuringBackward);
        }
        if !self.layout.regroup {
            return Err(DdpError::Policy {
                policy: self.policy_name.clone(),
                reason:
                    "it fixes its buckets (e.g. its optimizer state is cut from them): the bucket caps cannot change"
                        .into(),
            });
        }
        let order: Vec<usize> = st.buckets.iter().flat_map(|b| b.params.iter().copied()).collect();
        let groups = group_params(&self.params, &order, caps);
        self.regroup(st, groups)?;
        st.caps = caps;
        Ok(())
    }

    /// PyTorch's `prepare_for_backward`: resets the pass and marks unused parameters.
    fn start_pass(&self, st: &mut State, in_graph: &[usize]) -> Result<()> {
        if st.in_backward {
            // A pass that failed without telling us (backward_aborted not called): take
            // back what it launched before starting afresh.
            self.abort_pass(st);
        }
        if !st.sync {
            return Ok(());
        }
        st.in_backward = true;
        st.joined = false;
        st.next_launch = 0;
        st.ready.iter_mut().for_each(|r| *r = false);
        st.ready_order.clear();
        st.pass = PassTimes {
            started: Some(Instant::now()),
            grad_ready: vec![None; self.params.len()],
            ..PassTimes::default()
        };
        for b in st.buckets.iter_mut() {
            b.pending = b.params.len();
        }
        let mut used = vec![false; self.params.len()];
        for &p in in_graph {
            used[p] = true;
        }
        let unused: Vec<usize> = (0..self.params.len())
            .filter(|&p| self.trainable[p] && !used[p])
            .collect();
        if unused.is_empty() {
            return Ok(());
        }
        if !self.cfg.find_unused_parameters {
            st.in_backward = false;
            let params = unused.iter().map(|&p| self.name(p).to_string()).collect();
            return Err(DdpError::UnusedParameters {
                rank: self.comm.rank(),
                params,
            });
        }
        // PyTorch's find_unused_parameters: mark them ready up front so no bucket waits on them.
        for p in unused {
            self.attach(st, p)?;
            self.mark_ready(st, p)?;
        }
        Ok(())
    }

    /// PyTorch's `finalize_backward`: waits for every bucket, then rebuilds them once.
    fn finish_pass(&self, st: &mut State) -> Result<()> {
        st.in_backward = false;
        st.pass.compute_end = Some(Instant::now());
        if st.next_launch < st.buckets.len() {
            let params = (0..self.params.len())
                .filter(|&p| self.trainable[p] && !st.ready[p])
                .map(|p| self.name(p).to_string())
                .collect();
            // Give back whatever was launched before reporting.
            let _ = self.wait_all(st);
            return Err(DdpError::NeverReady {
                rank: self.comm.rank(),
                params,
            });
        }
        self.wait_all(st)?;
        if !st.rebuilt {
            self.rebuild(st)?;
        }
        Ok(())
    }

    /// A pass that failed midway: waits for the buckets it launched so that every gradient
    /// view has its storage back (their values are partial: zero them before the next
    /// pass). The comm streams of the ranks stay in step only if every rank launched the
    /// same buckets; otherwise the next collective fails on every rank as a mismatch.
    fn abort_pass(&self, st: &mut State) {
        if st.in_backward {
            let _ = self.wait_all(st);
            st.in_backward = false;
        }
    }

    /// A synchronized pass for a rank with no data this step (uneven inputs): every bucket is
    /// zero and goes to the policy's `reduce_joined`, in bucket order, so that this rank issues
    /// the collectives the others issue in their backward.
    pub(crate) fn join_pass(&self) -> Result<()> {
        let mut st = self.lock();
        if !st.sync {
            return Err(DdpError::Policy {
                policy: self.policy_name.clone(),
                reason: "a rank cannot join (take part without data) inside no_sync: nothing is reduced there".into(),
            });
        }
        let all: Vec<usize> = (0..self.params.len()).filter(|&p| self.trainable[p]).collect();
        self.start_pass(&mut st, &all)?;
        st.joined = true;
        for b in 0..st.buckets.len() {
            let params = st.buckets[b].params.clone();
            for &p in &params {
                self.attach(&mut st, p)?;
            }
            st.buckets[b].flat.fill(0.0)?;
        }
        let order: Vec<usize> = st.buckets.iter().flat_map(|b| b.params.clone()).collect();
        let marked = order.into_iter().try_for_each(|p| self.mark_ready(&mut st, p));
        let finished = match marked {
            Ok(()) => self.finish_pass(&mut st),
            Err(e) => {
                self.abort_pass(&mut st);
                Err(e)
            }
        };
        st.joined = false;
        finished
    }

    /// When parameter `p`'s gradient becomes final: if its bucket's full buffer was freed by a
    /// shard reduction (ZeRO-2), gives it zeros again (the last step's shard is dropped), and
    /// moves the gradient into its slice unless it already accumulates there. In synchronized
    /// and `no_sync` passes alike.
    fn attach(&self, st: &mut State, p: usize) -> Result<()> {
        if !self.trainable[p] {
            return Ok(());
        }
        let b = st.bucket_of[p];
        let bucket = &mut st.buckets[b];
        if is_lent(&bucket.flat) && bucket.work.is_none() {
            bucket.held = Held::Nothing;
            restore_zeros(&bucket.flat)?;
        }
        if self.params[p].grad().is_some_and(|g| g.shares_storage(&bucket.flat)) {
            return Ok(());
        }
        let offset: usize = bucket
            .params
            .iter()
            .take_while(|&&q| q != p)
            .map(|&q| self.params[q].value().numel())
            .sum();
        self.params[p].set_grad_buffer(bucket.flat.flat_view(offset, &self.params[p].shape())?)?;
        Ok(())
    }
}

impl GradSubscriber for Reducer {
    fn backward_started(&self, in_graph: &[usize]) -> std::result::Result<(), SubscriberError> {
        let mut st = self.lock();
        Ok(self.start_pass(&mut st, in_graph)?)
    }

    fn node_backward(&self, scope: Option<&str>, _op: &str) {
        let Some(rec) = &self.recorder else { return };
        let mut st = self.lock();
        let kind = EventKind::backward(scope);
        if st.span.as_ref().is_some_and(|(k, _)| *k == kind) {
            return;
        }
        self.end_span(&mut st);
        let id = rec.begin(self.comm.rank(), kind.clone());
        self.stream.compute_scope(Some(id));
        st.span = Some((kind, id));
    }

    fn grad_ready(&self, ready: GradReady<'_>) -> std::result::Result<(), SubscriberError> {
        let mut st = self.lock();
        self.attach(&mut st, ready.index)?;
        if !st.sync {
            return Ok(());
        }
        if !st.in_backward {
            return Err(Box::new(DdpError::ReadyOutsideBackward {
                param: ready.name.to_string(),
            }));
        }
        Ok(self.mark_ready(&mut st, ready.index)?)
    }

    fn backward_finished(&self) -> std::result::Result<(), SubscriberError> {
        let mut st = self.lock();
        self.end_span(&mut st);
        if !st.sync {
            return Ok(());
        }
        Ok(self.finish_pass(&mut st)?)
    }

    fn backward_aborted(&self) {
        let mut st = self.lock();
        self.end_span(&mut st);
        self.abort_pass(&mut st);
    }
}
