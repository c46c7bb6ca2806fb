//! Which stream of a device this thread's ops go to: a per-thread stack of scopes set by
//! [`crate::Stream::scope`] (PyTorch's `with torch.cuda.stream(s):`). A backend asks for the
//! innermost scope of its device and falls back to the device's compute stream.

use std::any::Any;
use std::cell::RefCell;
use std::sync::Arc;

use crate::Device;

/// A backend's stream, as the scope stack keeps it (each backend downcasts its own).
pub(crate) type ScopedStream = Arc<dyn Any + Send + Sync>;

thread_local! {
    static SCOPES: RefCell<Vec<(Device, ScopedStream)>> = const { RefCell::new(Vec::new()) };
}

/// The innermost stream this thread set for `device`, if any.
pub(crate) fn current(device: Device) -> Option<ScopedStream> {
    SCOPES.with(|s| {
        s.borrow()
            .iter()
            .rev()
            .find(|(d, _)| *d == device)
            .map(|(_, st)| st.clone())
    })
}

/// Pops the scope it pushed, also when `f` panics.
struct Pop;

impl Drop for Pop {
    fn drop(&mut self) {
        SCOPES.with(|s| {
            s.borrow_mut().pop();
        });
    }
}

/// Runs `f` with `stream` as this thread's stream for `device`.
pub(crate) fn with_stream<R>(device: Device, stream: ScopedStream, f: impl FnOnce() -> R) -> R {
    SCOPES.with(|s| s.borrow_mut().push((device, stream)));
    let _pop = Pop;
    f()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::{current, with_stream};
    use crate::Device;

    fn id(d: Device) -> Option<u32> {
        current(d).and_then(|s| s.downcast_ref::<u32>().copied())
    }

    #[test]
    fn scopes_nest_per_device_and_end_with_their_closure_even_on_a_panic() {
        let (a, b) = (Device::Fake(7), Device::Fake(8));
        assert_eq!(id(a), None);
        with_stream(a, Arc::new(1u32), || {
            assert_eq!((id(a), id(b)), (Some(1), None));
            with_stream(b, Arc::new(2u32), || {
                with_stream(a, Arc::new(3u32), || assert_eq!((id(a), id(b)), (Some(3), Some(2))));
                assert_eq!((id(a), id(b)), (Some(1), Some(2)));
            });
            // another thread does not see this thread's scope
            std::thread::spawn(move || assert_eq!(id(a), None)).join().unwrap();
        });
        assert_eq!(id(a), None);
        let caught = std::panic::catch_unwind(|| with_stream(a, Arc::new(4u32), || panic!("in scope")));
        assert!(caught.is_err());
        assert_eq!(id(a), None, "the panicking scope was popped");
    }
}
