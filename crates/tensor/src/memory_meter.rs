//! Allocation accounting: the live and peak bytes of the tensor storages a thread allocates
//! while a [`MemoryMeter`] is installed on it, so that a rank's memory can be measured (the
//! tensor crate's view of PyTorch's `torch.cuda.memory_allocated` / `max_memory_allocated`).
//!
//! Every storage made while a meter is installed on the making thread charges the meter its
//! bytes (elements times element size) and gives them back when its last view is dropped, on
//! whatever thread that happens. A storage lent out ([`crate::Tensor::lend_storage`]) stays
//! charged: its memory is still in use, on the comm stream. Storages made on threads without
//! a meter (a comm stream's thread, another rank's) are not counted. The cost without a meter
//! is one thread-local read per storage made.

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Live and peak bytes of the tensor storages made on the threads it is installed on.
#[derive(Debug, Default)]
pub struct MemoryMeter {
    live: AtomicUsize,
    peak: AtomicUsize,
}

thread_local! {
    static METER: RefCell<Option<Arc<MemoryMeter>>> = const { RefCell::new(None) };
}

impl MemoryMeter {
    /// A meter at zero.
    pub fn new() -> Arc<MemoryMeter> {
        Arc::default()
    }

    /// Bytes of the storages charged to this meter that are alive now.
    pub fn live(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    /// The most bytes alive at once since the meter was made or [`MemoryMeter::reset_peak`].
    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }

    /// Starts a new peak from the bytes alive now (at the start of a step).
    pub fn reset_peak(&self) {
        self.peak.store(self.live(), Ordering::Relaxed);
    }

    /// Charges every storage this thread makes from now on to `meter` (`None`: to no meter);
    /// returns the meter installed before.
    pub fn install(meter: Option<Arc<MemoryMeter>>) -> Option<Arc<MemoryMeter>> {
        METER.with(|m| std::mem::replace(&mut *m.borrow_mut(), meter))
    }

    /// The meter installed on this thread, if any.
    pub fn current() -> Option<Arc<MemoryMeter>> {
        METER.with(|m| m.borrow().clone())
    }

    fn add(&self, bytes: usize) {
        let now = self.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }
}

/// One storage's bytes charged to a meter, given back when it is dropped.
#[derive(Debug)]
pub(crate) struct Charge {
    meter: Arc<MemoryMeter>,
    bytes: usize,
}

impl Charge {
    /// `bytes` charged to this thread's meter, or `None` without one.
    pub(crate) fn here(bytes: usize) -> Option<Charge> {
        METER.with(|m| {
            let meter = m.borrow().clone()?;
            meter.add(bytes);
            Some(Charge { meter, bytes })
        })
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.meter.live.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::MemoryMeter;
    use crate::{DType, Tensor};

    #[test]
    fn storages_are_charged_once_while_alive_and_the_peak_holds_the_most_at_once() {
        let meter = MemoryMeter::new();
        let before = MemoryMeter::install(Some(meter.clone()));
        let a = Tensor::zeros(&[4, 8], DType::F32); // 128 bytes
        let view = a.transpose(0, 1).unwrap(); // the same storage: no charge
        assert_eq!(meter.live(), 128);
        let b = a.add(&a).unwrap(); // 128 more
        assert_eq!((meter.live(), meter.peak()), (256, 256));
        drop(b);
        assert_eq!((meter.live(), meter.peak()), (128, 256));
        meter.reset_peak();
        assert_eq!(meter.peak(), 128);
        drop(a);
        assert_eq!(meter.live(), 128, "the view keeps the storage alive");
        drop(view);
        assert_eq!(meter.live(), 0);
        // another thread's storages are its own meter's (none here)
        std::thread::spawn(|| Tensor::zeros(&[64], DType::F64)).join().unwrap();
        assert_eq!(meter.peak(), 128);
        MemoryMeter::install(before);
        let _c = Tensor::zeros(&[8], DType::F32);
        assert_eq!(meter.live(), 0, "uninstalled: not charged");
    }

    #[test]
    fn a_freed_storage_is_given_back_and_a_restored_one_charged_again() {
        let meter = MemoryMeter::new();
        let before = MemoryMeter::install(Some(meter.clone()));
        let p = Tensor::zeros(&[4, 8], DType::F32); // 128 bytes
        let view = p.reshape(&[32]).unwrap();
        // lent: still in use elsewhere, still charged
        let lent = p.lend_storage().unwrap();
        assert_eq!(meter.live(), 128);
        p.restore_storage(lent).unwrap();
        assert_eq!(meter.live(), 128, "restored after a lend: charged once");
        // freed in place: the bytes go though the tensor and its views stay
        p.free_storage().unwrap();
        assert_eq!(meter.live(), 0);
        assert!(view.to_vec::<f32>().is_err(), "a freed storage is not read");
        let fill = Tensor::ones(&[32], DType::F32);
        assert_eq!(meter.live(), 128);
        p.restore_storage(fill.lend_storage().unwrap()).unwrap();
        drop(fill);
        assert_eq!(meter.live(), 128, "restored into a freed tensor: charged to it");
        assert_eq!(view.to_vec::<f32>().unwrap(), vec![1.0; 32]);
        drop((p, view));
        assert_eq!(meter.live(), 0);
        MemoryMeter::install(before);
    }

    #[test]
    fn freeing_a_tensor_whose_storage_is_lent_gives_its_bytes_back() {
        let meter = MemoryMeter::new();
        let before = MemoryMeter::install(Some(meter.clone()));
        let bucket = Tensor::zeros(&[32], DType::F32); // 128 bytes
        let (buffer, lent) = bucket.lend_buffer().unwrap();
        assert!(lent);
        assert_eq!(meter.live(), 128, "lent: in use elsewhere");
        // a collective consumed it: it will not come back
        drop(buffer);
        bucket.free_storage().unwrap();
        assert_eq!(meter.live(), 0);
        bucket
            .restore_storage(Tensor::zeros(&[32], DType::F32).lend_storage().unwrap())
            .unwrap();
        assert_eq!(meter.live(), 128, "a new storage is charged again");
        MemoryMeter::install(before);
    }
}
