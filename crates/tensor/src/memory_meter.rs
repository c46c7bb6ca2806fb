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
//!
//! Each storage is charged to a part ([`MemoryMeter::in_part`]: the innermost part set on the
//! making thread, 0 where none is), so that the peak splits into what held it: the meter keeps
//! each part's live bytes at the moment of the peak ([`MemoryMeter::peak_parts`]). The parts'
//! names are the caller's (DDP names its own).

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// How many parts a [`MemoryMeter`] splits its bytes into (part 0: storages made outside any).
pub const MEMORY_PARTS: usize = 8;

/// Live and peak bytes of the tensor storages made on the threads it is installed on.
#[derive(Debug, Default)]
pub struct MemoryMeter {
    live: AtomicUsize,
    peak: AtomicUsize,
    /// Live bytes of each part.
    parts: [AtomicUsize; MEMORY_PARTS],
    /// Each part's live bytes when `peak` was reached.
    at_peak: [AtomicUsize; MEMORY_PARTS],
}

thread_local! {
    static METER: RefCell<Option<Arc<MemoryMeter>>> = const { RefCell::new(None) };
    static PART: Cell<usize> = const { Cell::new(0) };
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
        self.snapshot();
    }

    /// Each part's bytes alive when the peak was reached (they add up to [`MemoryMeter::peak`]
    /// but for storages made or dropped on another thread at that moment).
    pub fn peak_parts(&self) -> [usize; MEMORY_PARTS] {
        std::array::from_fn(|i| self.at_peak[i].load(Ordering::Relaxed))
    }

    /// Runs `f` with the storages this thread makes charged to `part` (below
    /// [`MEMORY_PARTS`]; an inner call's part wins), and returns what it returns.
    pub fn in_part<T>(part: usize, f: impl FnOnce() -> T) -> T {
        let _part = MemoryMeter::enter_part(part);
        f()
    }

    /// Charges the storages this thread makes to `part` until the guard drops.
    pub fn enter_part(part: usize) -> PartGuard {
        assert!(part < MEMORY_PARTS, "memory part {part} of {MEMORY_PARTS}");
        PartGuard(PART.with(|p| p.replace(part)))
    }

    /// The part this thread's storages are charged to now.
    pub fn current_part() -> usize {
        PART.with(Cell::get)
    }

    fn snapshot(&self) {
        for (at, now) in self.at_peak.iter().zip(&self.parts) {
            at.store(now.load(Ordering::Relaxed), Ordering::Relaxed);
        }
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

    fn add(&self, bytes: usize, part: usize) {
        self.parts[part].fetch_add(bytes, Ordering::Relaxed);
        let now = self.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        if self.peak.fetch_max(now, Ordering::Relaxed) < now {
            self.snapshot();
        }
    }
}

/// The part a thread charged its storages to before [`MemoryMeter::enter_part`], restored when
/// this drops.
#[derive(Debug)]
pub struct PartGuard(usize);

impl Drop for PartGuard {
    fn drop(&mut self) {
        PART.with(|p| p.set(self.0));
    }
}

/// One storage's bytes charged to a meter, given back when it is dropped.
#[derive(Debug)]
pub(crate) struct Charge {
    meter: Arc<MemoryMeter>,
    bytes: usize,
    part: usize,
}

impl Charge {
    /// `bytes` charged to this thread's meter, in its current part, or `None` without one.
    pub(crate) fn here(bytes: usize) -> Option<Charge> {
        METER.with(|m| {
            let meter = m.borrow().clone()?;
            let part = MemoryMeter::current_part();
            meter.add(bytes, part);
            Some(Charge { meter, bytes, part })
        })
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.meter.parts[self.part].fetch_sub(self.bytes, Ordering::Relaxed);
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

    #[test]
    fn the_peak_splits_into_the_parts_alive_at_that_moment() {
        let meter = MemoryMeter::new();
        let before = MemoryMeter::install(Some(meter.clone()));
        let rest = Tensor::zeros(&[8], DType::F32); // 32 bytes, part 0
        let a = MemoryMeter::in_part(1, || {
            let a = Tensor::zeros(&[16], DType::F32); // 64 bytes, part 1
            let b = MemoryMeter::in_part(2, || Tensor::zeros(&[4], DType::F32)); // 16, part 2
            drop(b);
            a
        });
        // the peak was 32 + 64 + 16, with part 2 alive
        assert_eq!(meter.peak(), 112);
        assert_eq!(meter.peak_parts()[..3], [32, 64, 16]);
        drop(a);
        let c = Tensor::zeros(&[2], DType::F32);
        assert_eq!(meter.peak_parts()[..3], [32, 64, 16], "below the peak: the split stays");
        meter.reset_peak();
        assert_eq!(meter.peak_parts()[..3], [40, 0, 0]);
        assert_eq!(MemoryMeter::current_part(), 0);
        drop((rest, c));
        MemoryMeter::install(before);
    }
}
