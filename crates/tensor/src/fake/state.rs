//! One fake device's bookkeeping: what it counted, its streams' vector clocks (which op of
//! which stream is known to come before which), and the optional log of every op.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// What a fake device counted since it was created or last [`reset`](super::reset).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FakeCounts {
    /// Host-to-device copies (an upload: `to_device`, `from_host_vec`).
    pub to_device: u64,
    /// Bytes moved host-to-device.
    pub to_device_bytes: u64,
    /// Device-to-host copies (`to_vec`, `item`, `into_host_vec`): on a GPU each one drains the
    /// stream it runs on, so inside a training step each is a stall.
    pub to_host: u64,
    /// Bytes moved device-to-host.
    pub to_host_bytes: u64,
    /// Explicit host waits: [`crate::Stream::synchronize`] and [`crate::Event::synchronize`].
    pub host_waits: u64,
    /// Kernels: every contract call that runs on a stream (copies in and out excluded).
    pub kernels: u64,
    /// Buffers freed while another stream's use of them was not yet known to be finished
    /// before their own stream: what the CUDA backend keeps alive until that use's event
    /// completed (the keep-alive rule).
    pub deferred_frees: u64,
}

/// What one op of the fake device's log was.
#[derive(Debug, Clone, PartialEq)]
pub enum FakeWhat {
    /// A kernel (the contract method's name, e.g. `matmul`, `sgd_step`).
    Kernel(&'static str),
    /// A host-to-device copy of this many bytes.
    ToDevice(u64),
    /// A device-to-host copy of this many bytes (the host waited for the stream).
    ToHost(u64),
    /// An event was recorded (its id).
    Record(u64),
    /// The stream waited on an event (its id) recorded on another stream (or the same).
    Wait {
        /// The event.
        event: u64,
        /// The stream it was recorded on.
        recorded_on: u64,
    },
    /// The host waited for the stream (or for an event of it).
    HostWait,
    /// Raw memory of a storage was handed to code outside the contract (a collective) that
    /// will read and write it on this stream.
    Lent,
    /// A delay kernel of this duration (the simulated link).
    Spin(Duration),
}

/// One op of a fake device, in issue order.
#[derive(Debug, Clone, PartialEq)]
pub struct FakeOp {
    /// The stream it ran on: 0 is the device's compute stream; streams made with
    /// [`crate::Stream::new`] count up from 1 (their [`crate::Stream::raw_handle`]).
    pub stream: u64,
    /// What it was.
    pub what: FakeWhat,
}

/// Stream -> the last op number of that stream known to be finished before "now".
pub(crate) type Clock = HashMap<u64, u64>;

fn merge(into: &mut Clock, from: &Clock) {
    for (&s, &q) in from {
        let e = into.entry(s).or_insert(0);
        *e = (*e).max(q);
    }
}

/// Where a use of a storage happened: a stream and that stream's op number.
pub(crate) type Stamp = (u64, u64);

/// The mutable state of one fake device.
#[derive(Default)]
pub(crate) struct Inner {
    pub(crate) counts: FakeCounts,
    next_stream: u64,
    next_event: u64,
    clocks: HashMap<u64, Clock>,
    host: Clock,
    log: Option<Vec<FakeOp>>,
}

impl Inner {
    /// Starts op number `n` on `stream` (after everything the host already waited for) and
    /// returns its stamp.
    pub(crate) fn issue(&mut self, stream: u64) -> Stamp {
        let host = self.host.clone();
        let clock = self.clocks.entry(stream).or_default();
        merge(clock, &host);
        let seq = clock.get(&stream).copied().unwrap_or(0) + 1;
        clock.insert(stream, seq);
        (stream, seq)
    }

    /// Whether the use `(t, q)` is known to be finished before what `stream` runs now.
    pub(crate) fn ordered(&self, stream: u64, (t, q): Stamp) -> bool {
        t == stream
            || self
                .clocks
                .get(&stream)
                .and_then(|c| c.get(&t))
                .is_some_and(|&s| s >= q)
            || self.host.get(&t).is_some_and(|&s| s >= q)
    }

    /// Starts (or restarts, empty) the log.
    pub(crate) fn log_start(&mut self) {
        self.log = Some(Vec::new());
    }

    /// The ops logged so far (the log goes on, empty).
    pub(crate) fn log_take(&mut self) -> Vec<FakeOp> {
        self.log.as_mut().map(std::mem::take).unwrap_or_default()
    }

    pub(crate) fn log(&mut self, stream: u64, what: FakeWhat) {
        if let Some(log) = &mut self.log {
            log.push(FakeOp { stream, what });
        }
    }

    /// The host waited for everything `stream` ran so far.
    pub(crate) fn host_waited_for_stream(&mut self, stream: u64) {
        let c = self.clocks.entry(stream).or_default().clone();
        merge(&mut self.host, &c);
    }

    pub(crate) fn new_stream(&mut self) -> u64 {
        self.next_stream += 1;
        self.next_stream
    }

    /// Records an event on `stream`: its id and the clock it captures.
    pub(crate) fn record(&mut self, stream: u64) -> (u64, Clock) {
        self.next_event += 1;
        let id = self.next_event;
        let host = self.host.clone();
        let clock = self.clocks.entry(stream).or_default();
        merge(clock, &host);
        let snapshot = clock.clone();
        self.log(stream, FakeWhat::Record(id));
        (id, snapshot)
    }

    /// `stream` waits on an event that captured `clock`.
    pub(crate) fn wait(&mut self, stream: u64, event: u64, recorded_on: u64, clock: &Clock) {
        merge(self.clocks.entry(stream).or_default(), clock);
        self.log(stream, FakeWhat::Wait { event, recorded_on });
    }

    /// The host waited for an event that captured `clock`.
    pub(crate) fn host_wait(&mut self, stream: u64, clock: &Clock) {
        merge(&mut self.host, clock);
        self.counts.host_waits += 1;
        self.log(stream, FakeWhat::HostWait);
    }
}

/// One fake device (one ordinal), shared by every storage and stream on it.
pub(crate) struct FakeDevice {
    pub(crate) ordinal: usize,
    inner: Mutex<Inner>,
}

impl FakeDevice {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The fake device with this ordinal, created on first use.
pub(crate) fn device(ordinal: usize) -> Arc<FakeDevice> {
    static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<FakeDevice>>>> = OnceLock::new();
    let mut map = DEVICES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    map.entry(ordinal)
        .or_insert_with(|| {
            Arc::new(FakeDevice {
                ordinal,
                inner: Mutex::new(Inner::default()),
            })
        })
        .clone()
}

/// A stream of a fake device, as [`crate::Stream`] and the scope stack hold it.
#[derive(Clone)]
pub(crate) struct FakeStream {
    pub(crate) dev: Arc<FakeDevice>,
    pub(crate) id: u64,
}

/// An event of a fake device: the clock of its stream when it was recorded.
pub(crate) struct FakeEvent {
    pub(crate) dev: Arc<FakeDevice>,
    pub(crate) id: u64,
    pub(crate) stream: u64,
    pub(crate) clock: Clock,
    pub(crate) at: Instant,
}

#[cfg(test)]
mod tests {
    use super::Inner;

    #[test]
    fn vector_clocks_order_a_use_only_through_an_event_wait_or_a_host_wait() {
        let mut d = Inner::default();
        let side = d.new_stream();
        let w = d.issue(0); // compute writes
        assert!(!d.ordered(side, w), "no wait yet");
        let (e, clock) = d.record(0);
        let later = d.issue(0); // after the event: not covered by it
        d.wait(side, e, 0, &clock);
        assert!(d.ordered(side, w) && !d.ordered(side, later));
        // transitively: a third stream that waits on an event of `side` sees compute's write
        let third = d.new_stream();
        let (e2, c2) = d.record(side);
        d.wait(third, e2, side, &c2);
        assert!(d.ordered(third, w) && !d.ordered(third, later));
        // a host wait for compute orders everything compute ran before it, for every stream
        d.host_waited_for_stream(0);
        assert!(d.ordered(side, later) && d.ordered(third, later));
    }
}
