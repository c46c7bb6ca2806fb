//! Host memory that the other processes of a node can map: the **shared heap**, so that ranks
//! in different processes reduce each other's buffers in place, as the thread backend's ranks do
//! inside one process.
//!
//! A buffer in a process's private memory reaches a peer process only through copies: into a
//! shared segment and out again. Each rank then moves about twice the bytes the thread backend
//! moves, and on 2 ranks its all-reduce cannot pass half a memcpy's bandwidth. A buffer that lives
//! in memory every local rank has mapped is read and written where it is.
//!
//! # How a buffer gets there
//! - The process's heap is one `memfd` (anonymous shared memory, sparse: a page costs memory once
//!   it is touched), mapped once, [`HEAP_BYTES`] of address space. It exists once a communicator
//!   that can use it asked for it (the MPI backend with its shared segment, at start-up).
//! - [`host_vec`] allocates a collective's buffer (DDP's buckets, the bench's buffers) there when
//!   the heap exists, and from the ordinary allocator otherwise. It is an ordinary `Vec`: its
//!   memory goes back to the heap when it is dropped, because the program's global allocator is
//!   [`SharedHeap`], which sends every other allocation to the system allocator and frees by
//!   address. A program that does not install it gets no heap, and its collectives copy.
//! - The peers map the heap through `/proc/<pid>/fd/<fd>` (the same user's processes on one
//!   host), once `/proc` names it a Brigade heap and its first page holds the random nonce its
//!   owner announced; anything else is unmapped unwritten. Where that fails on any rank, every
//!   rank goes on without it.
//!
//! A `Vec` from the heap that grows or shrinks moves to the system allocator (and its
//! collectives copy from then on). Blocks of a page or more from the system allocator start on
//! a cache line too, as the heap's do ([`LINE_FROM_BYTES`]).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{Mutex, OnceLock};

/// Address space of a process's heap (touched pages only cost memory).
pub const HEAP_BYTES: usize = 64 << 30;
/// Heap blocks start and end on page boundaries.
const PAGE: usize = 4096;
/// The environment variable that turns the heap off (`0`): collectives then copy through the
/// segment, as before it existed (for comparisons).
pub const HEAP_VAR: &str = "BRIGADE_SHM_HEAP";

/// The global allocator that makes [`host_vec`]'s buffers possible:
/// `#[global_allocator] static HEAP: brigade_comm::SharedHeap = brigade_comm::SharedHeap;`
/// in the program's `main.rs` (the `brigade` binary has it). Every allocation goes to the
/// system allocator; a free (or a reallocation) of an address inside the shared heap goes back
/// to the heap.
#[derive(Debug, Clone, Copy, Default)]
pub struct SharedHeap;

/// Set by the first allocation [`SharedHeap`] serves: then it is the global allocator, and a
/// `Vec` built on heap memory is freed back to the heap.
static INSTALLED: AtomicBool = AtomicBool::new(false);

fn mark_installed() {
    // A load first: after the first call the line is only read, never bounced between cores.
    if !INSTALLED.load(Relaxed) {
        INSTALLED.store(true, Relaxed);
    }
}

// SAFETY: every block comes from `System` or from the heap, and goes back to where it came
// from (the heap's blocks are recognized by address).
unsafe impl GlobalAlloc for SharedHeap {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        mark_installed();
        // SAFETY: the caller's layout, at most more aligned.
        unsafe { System.alloc(on_a_line(layout)) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        mark_installed();
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(on_a_line(layout)) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        match heap().filter(|h| h.contains(ptr)) {
            Some(heap) => heap.free(ptr, layout.size()),
            // SAFETY: not the heap's, so `System`'s, allocated with this layout on a line.
            None => unsafe { System.dealloc(ptr, on_a_line(layout)) },
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        match heap().filter(|h| h.contains(ptr)) {
            Some(heap) => {
                // SAFETY: `new_size` with the old alignment is a valid layout (the caller's
                // contract); the old block holds `layout.size()` bytes.
                unsafe {
                    let moved = System.alloc(on_a_line(Layout::from_size_align_unchecked(new_size, layout.align())));
                    if !moved.is_null() {
                        std::ptr::copy_nonoverlapping(ptr, moved, layout.size().min(new_size));
                        heap.free(ptr, layout.size());
                    }
                    moved
                }
            }
            // SAFETY: not the heap's, so `System`'s, allocated with this layout on a line.
            None => unsafe { system_realloc(ptr, layout, new_size) },
        }
    }
}

/// Blocks of at least this many bytes start on a cache line.
pub const LINE_FROM_BYTES: usize = 4096;
/// A cache line.
const LINE: usize = 64;

/// `layout`, aligned to a cache line when it holds [`LINE_FROM_BYTES`] or more. The system
/// allocator aligns to 16 bytes; a GEMM reading operands that start 16 or 32 bytes past a line
/// splits loads across lines while it packs them (about 8% of a 1024x256x768 `dnnl_sgemm`,
/// measured), and PyTorch's CPU allocator starts every block on a line.
fn on_a_line(layout: Layout) -> Layout {
    if layout.size() >= LINE_FROM_BYTES && layout.align() < LINE {
        // SAFETY: a power of two, and the size did fit the smaller alignment: rounded up to a
        // line it stays below isize::MAX - LINE, which no block of the system's reaches.
        unsafe { Layout::from_size_align_unchecked(layout.size(), LINE) }
    } else {
        layout
    }
}

/// [`GlobalAlloc::realloc`] of a block of `System`'s allocated with `on_a_line(layout)`.
///
/// # Safety
/// As `realloc`: `ptr` was allocated by `System` with `on_a_line(layout)`, `new_size` is
/// valid with `layout`'s alignment.
unsafe fn system_realloc(ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
    let (old, new) = (
        on_a_line(layout),
        // SAFETY: the caller's contract.
        on_a_line(unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) }),
    );
    if old.align() == new.align() {
        // SAFETY: the same alignment before and after, as `System` expects.
        return unsafe { System.realloc(ptr, old, new_size) };
    }
    // across the threshold: a new block with the new alignment, the bytes moved over
    // SAFETY: `new` is a valid layout; both blocks hold at least the bytes copied.
    unsafe {
        let moved = System.alloc(new);
        if !moved.is_null() {
            std::ptr::copy_nonoverlapping(ptr, moved, layout.size().min(new_size));
            System.dealloc(ptr, old);
        }
        moved
    }
}

/// Where a peer finds a process's heap, and how it knows it found that one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Exposure {
    pub(crate) pid: u32,
    pub(crate) fd: i32,
    pub(crate) bytes: usize,
    /// A random number the heap's first page holds (after [`MAGIC`]): a peer that opened the
    /// wrong file (another process with that pid, seen from another pid namespace) finds
    /// something else there and never writes to it.
    pub(crate) nonce: u64,
}

/// The first word of every heap ("BRGDHEAP" in little-endian bytes); the nonce follows.
const MAGIC: u64 = u64::from_le_bytes(*b"BRGDHEAP");

/// One process's heap: its mapping, the memfd behind it, and its free blocks.
pub(crate) struct Heap {
    base: usize,
    len: usize,
    fd: i32,
    nonce: u64,
    /// Free blocks as `(offset, bytes)`, sorted by offset, never adjacent (merged on free).
    free: Mutex<Vec<(usize, usize)>>,
    /// Where in its first page a new block's data starts (a multiple of [`COLOR_ALIGN`]):
    /// see [`set_color`].
    color: AtomicUsize,
}

/// A block's data starts this aligned (at least: a cache line).
const COLOR_ALIGN: usize = 64;

/// The offset of `bytes` bytes at `ptr` in the `len` bytes at `base`, if they lie inside.
pub(crate) fn offset_in(base: *const u8, len: usize, ptr: *const u8, bytes: usize) -> Option<usize> {
    let off = (ptr as usize).wrapping_sub(base as usize);
    (off < len && bytes <= len - off).then_some(off)
}

impl Heap {
    fn contains(&self, ptr: *mut u8) -> bool {
        self.offset_of(ptr, 0).is_some()
    }

    /// `bytes` bytes at this heap's color in a block of whole pages, first fit; `None` when
    /// no free block is large enough.
    fn alloc(&self, bytes: usize) -> Option<*mut u8> {
        let color = self.color.load(Relaxed);
        let bytes = (bytes.max(1) + color).next_multiple_of(PAGE);
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let i = free.iter().position(|&(_, len)| len >= bytes)?;
        let (off, len) = free[i];
        if len == bytes {
            free.remove(i);
        } else {
            free[i] = (off + bytes, len - bytes);
        }
        Some((self.base + off + color) as *mut u8)
    }

    /// Gives back the block of the `bytes` bytes at `ptr` (from [`Heap::alloc`]: its color is
    /// where it starts in its first page).
    fn free(&self, ptr: *mut u8, bytes: usize) {
        let data = ptr as usize - self.base;
        let off = data - data % PAGE;
        let bytes = (bytes.max(1) + (data - off)).next_multiple_of(PAGE);
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let i = free.partition_point(|&(o, _)| o < off);
        let joins_next = i < free.len() && off + bytes == free[i].0;
        let joins_prev = i > 0 && free[i - 1].0 + free[i - 1].1 == off;
        match (joins_prev, joins_next) {
            (true, true) => {
                free[i - 1].1 += bytes + free[i].1;
                free.remove(i);
            }
            (true, false) => free[i - 1].1 += bytes,
            (false, true) => free[i] = (off, bytes + free[i].1),
            (false, false) => free.insert(i, (off, bytes)),
        }
    }

    /// Where a peer finds this heap.
    pub(crate) fn exposure(&self) -> Exposure {
        Exposure {
            pid: sys::pid(),
            fd: self.fd,
            bytes: self.len,
            nonce: self.nonce,
        }
    }

    /// The offset of `bytes` bytes at `ptr` in this heap, if they lie inside it.
    pub(crate) fn offset_of(&self, ptr: *const u8, bytes: usize) -> Option<usize> {
        offset_in(self.base(), self.len, ptr, bytes)
    }

    /// The base address of this process's mapping.
    pub(crate) fn base(&self) -> *mut u8 {
        self.base as *mut u8
    }
}

static HEAP: OnceLock<Option<Heap>> = OnceLock::new();

/// Starts this process's later heap buffers at the `k`-th of `of` places in their first page
/// (local rank `k` of `of`), so that the node's ranks' buffers do not lie at the same offset in
/// their pages.
///
/// With every rank's buffer page-aligned, a 2-rank in-place all-reduce of 1 MiB took 105-120
/// µs, against 38-45 µs with the ranks' buffers half a page apart, and against the thread
/// backend's 40 µs (3 alternated pairs, BENCHMARKS.md). At 16-64 MiB (memory-bound) the runs
/// could not tell the two apart. Why is not pinned down: the same reduction on two threads of
/// one process shows no such effect with same-offset buffers; it appears when two processes
/// reach the same pages through their own mappings.
pub(crate) fn set_color(k: usize, of: usize) {
    if let Some(heap) = heap() {
        let of = of.max(1);
        let color = (k % of) * PAGE / of;
        heap.color.store(color - color % COLOR_ALIGN, Relaxed);
    }
}

/// This process's heap, if one was made.
pub(crate) fn heap() -> Option<&'static Heap> {
    HEAP.get().and_then(Option::as_ref)
}

/// This process's heap, made on first call: `None` when [`SharedHeap`] is not the global
/// allocator, [`HEAP_VAR`] is `0`, or the system refused (the reason is printed once).
pub(crate) fn heap_or_make() -> Option<&'static Heap> {
    HEAP.get_or_init(|| {
        if !INSTALLED.load(Relaxed) || std::env::var(HEAP_VAR).is_ok_and(|v| v.trim() == "0") {
            return None;
        }
        match sys::map_new(HEAP_BYTES) {
            Ok((base, fd)) => {
                use std::hash::{BuildHasher, Hasher};
                let nonce = std::collections::hash_map::RandomState::new().build_hasher().finish();
                // SAFETY: the first page of our new mapping, kept out of the free list.
                unsafe {
                    base.cast::<u64>().write(MAGIC);
                    base.cast::<u64>().add(1).write(nonce);
                }
                Some(Heap {
                    base: base as usize,
                    len: HEAP_BYTES,
                    fd,
                    nonce,
                    free: Mutex::new(vec![(PAGE, HEAP_BYTES - PAGE)]),
                    color: AtomicUsize::new(0),
                })
            }
            Err(e) => {
                eprintln!("brigade-comm: no shared heap ({e}); collectives copy through the segment");
                None
            }
        }
    })
    .as_ref()
}

/// Maps a peer's heap (from its [`Heap::exposure`]), once per process, after checking that
/// the file is a Brigade heap and holds the peer's nonce (otherwise it is unmapped unwritten).
pub(crate) fn map_peer(peer: Exposure) -> Result<*mut u8, String> {
    static PEERS: Mutex<Vec<(Exposure, usize)>> = Mutex::new(Vec::new());
    if let Some(own) = heap().filter(|h| h.exposure() == peer) {
        return Ok(own.base());
    }
    let mut peers = PEERS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&(_, base)) = peers.iter().find(|(e, _)| *e == peer) {
        return Ok(base as *mut u8);
    }
    let base = sys::map_peer(peer.pid, peer.fd, peer.bytes)?;
    // SAFETY: the mapping is `peer.bytes` (> 16) long; reading it writes nothing.
    let (magic, nonce) = unsafe {
        (
            base.cast::<u64>().read_volatile(),
            base.cast::<u64>().add(1).read_volatile(),
        )
    };
    if (magic, nonce) != (MAGIC, peer.nonce) {
        sys::unmap(base, peer.bytes);
        return Err(format!(
            "/proc/{}/fd/{} is not that process's heap (another pid namespace?)",
            peer.pid, peer.fd
        ));
    }
    peers.push((peer, base as usize));
    Ok(base)
}

/// `len` copies of `value` in a `Vec` for a collective: in this process's shared heap when it
/// has one (see the module docs), so that the node's peers reduce it in place; from the
/// ordinary allocator otherwise. Either way an ordinary `Vec`.
pub fn host_vec<T: Copy>(len: usize, value: T) -> Vec<T> {
    let bytes = len * std::mem::size_of::<T>();
    let block = match heap() {
        Some(heap) if bytes > 0 && std::mem::align_of::<T>() <= COLOR_ALIGN => heap.alloc(bytes),
        _ => None,
    };
    match block {
        Some(ptr) => {
            let ptr = ptr.cast::<T>();
            // SAFETY: the block holds `len` `T`s, 64-byte aligned; `SharedHeap` takes it back
            // when the `Vec` is dropped (a heap exists only where it is the global allocator).
            unsafe {
                for i in 0..len {
                    ptr.add(i).write(value);
                }
                Vec::from_raw_parts(ptr, len, len)
            }
        }
        None => vec![value; len],
    }
}

/// Whether `data` lies in this process's shared heap (its all-reduces then run in place).
pub fn in_shared_heap<T>(data: &[T]) -> bool {
    in_heap(data.as_ptr().cast(), std::mem::size_of_val(data))
}

/// Whether `bytes` bytes at `ptr` lie in this process's shared heap.
pub(crate) fn in_heap(ptr: *const u8, bytes: usize) -> bool {
    heap().is_some_and(|h| h.offset_of(ptr, bytes).is_some())
}

#[cfg(target_os = "linux")]
mod sys {
    //! memfd, mmap and /proc through libc's symbols (every Rust program on Linux links libc).

    use std::ffi::{c_char, c_int, c_long, c_uint, c_void, CString};

    extern "C" {
        fn memfd_create(name: *const c_char, flags: c_uint) -> c_int;
        fn ftruncate(fd: c_int, len: i64) -> c_int;
        fn mmap(addr: *mut c_void, len: usize, prot: c_int, flags: c_int, fd: c_int, off: i64) -> *mut c_void;
        fn open(path: *const c_char, flags: c_int, ...) -> c_int;
        fn close(fd: c_int) -> c_int;
        fn getpid() -> c_int;
        fn munmap(addr: *mut c_void, len: usize) -> c_int;
    }

    const MFD_CLOEXEC: c_uint = 1;
    const PROT_READ: c_int = 1;
    const PROT_WRITE: c_int = 2;
    const MAP_SHARED: c_int = 1;
    const MAP_NORESERVE: c_int = 0x4000;
    const O_RDWR: c_int = 2;
    const O_CLOEXEC: c_int = 0o2000000;
    const O_NONBLOCK: c_int = 0o4000;
    /// What `/proc/<pid>/fd/<fd>` of a heap reads as.
    const MEMFD_LINK: &str = "/memfd:brigade-heap";

    pub(super) fn pid() -> u32 {
        // SAFETY: no arguments, cannot fail.
        unsafe { getpid() as u32 }
    }

    fn map(fd: c_int, bytes: usize) -> Result<*mut u8, String> {
        // SAFETY: a fresh shared mapping of `fd`; nothing else is at the address it returns.
        let ptr = unsafe {
            mmap(
                std::ptr::null_mut(),
                bytes,
                PROT_READ | PROT_WRITE,
                MAP_SHARED | MAP_NORESERVE,
                fd,
                0,
            )
        };
        if ptr as c_long == -1 {
            return Err(format!("mmap: {}", std::io::Error::last_os_error()));
        }
        Ok(ptr.cast())
    }

    /// A new memfd of `bytes`, mapped: `(base, fd)`.
    pub(super) fn map_new(bytes: usize) -> Result<(*mut u8, i32), String> {
        let name = CString::new("brigade-heap").expect("no NUL");
        // SAFETY: a valid C string; the fd is ours.
        let fd = unsafe { memfd_create(name.as_ptr(), MFD_CLOEXEC) };
        if fd < 0 {
            return Err(format!("memfd_create: {}", std::io::Error::last_os_error()));
        }
        // SAFETY: our fd.
        if unsafe { ftruncate(fd, bytes as i64) } != 0 {
            let e = std::io::Error::last_os_error();
            // SAFETY: our fd, closed once.
            unsafe { close(fd) };
            return Err(format!("ftruncate: {e}"));
        }
        match map(fd, bytes) {
            Ok(base) => Ok((base, fd)),
            Err(e) => {
                // SAFETY: our fd, closed once.
                unsafe { close(fd) };
                Err(e)
            }
        }
    }

    /// Maps process `pid`'s memfd `fd` (`bytes` long), if it is a Brigade heap's memfd.
    pub(super) fn map_peer(pid: u32, fd: i32, bytes: usize) -> Result<*mut u8, String> {
        let path = format!("/proc/{pid}/fd/{fd}");
        let target = std::fs::read_link(&path).map_err(|e| format!("{path}: {e}"))?;
        if !target.to_string_lossy().starts_with(MEMFD_LINK) {
            return Err(format!("{path} is {}, not a heap", target.display()));
        }
        let c_path = CString::new(path.clone()).expect("no NUL");
        // SAFETY: a valid C string; the fd is ours and closed below (the mapping keeps the
        // memory). Non-blocking: whatever the path turned into since, opening never waits.
        let own = unsafe { open(c_path.as_ptr(), O_RDWR | O_CLOEXEC | O_NONBLOCK) };
        if own < 0 {
            return Err(format!("open {path}: {}", std::io::Error::last_os_error()));
        }
        let mapped = map(own, bytes);
        // SAFETY: our fd, closed once.
        unsafe { close(own) };
        mapped
    }

    /// Unmaps a mapping of `bytes` at `base` (from `map_peer`).
    pub(super) fn unmap(base: *mut u8, bytes: usize) {
        // SAFETY: the caller's mapping, no longer used.
        unsafe { munmap(base.cast(), bytes) };
    }
}

#[cfg(not(target_os = "linux"))]
mod sys {
    pub(super) fn pid() -> u32 {
        std::process::id()
    }
    pub(super) fn map_new(_bytes: usize) -> Result<(*mut u8, i32), String> {
        Err("only on Linux".to_string())
    }
    pub(super) fn map_peer(_pid: u32, _fd: i32, _bytes: usize) -> Result<*mut u8, String> {
        Err("only on Linux".to_string())
    }
    pub(super) fn unmap(_base: *mut u8, _bytes: usize) {}
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn made() -> &'static Heap {
        heap_or_make().expect("the comm tests install SharedHeap; the heap is made")
    }

    /// Tests that take blocks of the process's heap, one at a time (a test that looks at the
    /// free list must not see another's blocks come and go).
    pub(crate) static HEAP_TESTS: Mutex<()> = Mutex::new(());

    #[test]
    fn a_host_vec_lives_in_the_heap_and_goes_back_to_it() {
        let _one = HEAP_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let heap = made();
        let v = host_vec(3000, 1.5f32);
        assert!(in_shared_heap(&v), "a host_vec is in the heap once it exists");
        assert!(v.iter().all(|&x| x == 1.5));
        let off = heap.offset_of(v.as_ptr().cast(), 12_000).expect("inside");
        assert_eq!(off % PAGE, 0);
        let is_free = || {
            let free = heap.free.lock().unwrap();
            free.iter().any(|&(o, l)| o <= off && off + 3 * PAGE <= o + l)
        };
        assert!(!is_free());
        drop(v);
        assert!(is_free(), "dropping the Vec gave its 3 pages back to the heap");
        let plain = vec![1.5f32; 3000];
        assert!(
            !in_shared_heap(&plain),
            "other allocations stay in the system allocator"
        );
    }

    /// A heap of 16 pages at a made-up address (its blocks are never touched).
    fn toy_heap() -> Heap {
        Heap {
            base: 1 << 20,
            len: 16 * PAGE,
            fd: -1,
            nonce: 0,
            free: Mutex::new(vec![(0, 16 * PAGE)]),
            color: AtomicUsize::new(0),
        }
    }

    #[test]
    fn free_blocks_merge_with_both_neighbours() {
        let heap = toy_heap();
        let a = heap.alloc(PAGE).unwrap();
        let b = heap.alloc(PAGE + 1).unwrap();
        let c = heap.alloc(PAGE).unwrap();
        assert_eq!(b as usize - a as usize, PAGE);
        assert_eq!(c as usize - b as usize, 2 * PAGE);
        assert!(heap.alloc(13 * PAGE).is_none(), "12 pages are left");
        heap.free(a, PAGE);
        heap.free(c, PAGE);
        assert_eq!(heap.free.lock().unwrap().len(), 2, "a, then c merged with the tail");
        heap.free(b, PAGE + 1);
        assert_eq!(*heap.free.lock().unwrap(), vec![(0, 16 * PAGE)]);
    }

    #[test]
    fn a_colored_block_starts_at_its_color_and_frees_whole() {
        let heap = toy_heap();
        heap.color.store(3 * PAGE / 4, Relaxed);
        let a = heap.alloc(PAGE).unwrap();
        assert_eq!(a as usize % PAGE, 3 * PAGE / 4);
        assert_eq!(a as usize - heap.base, 3 * PAGE / 4, "first fit, at the color");
        // A page of data from three quarters in spans two pages.
        assert_eq!(*heap.free.lock().unwrap(), vec![(2 * PAGE, 14 * PAGE)]);
        heap.color.store(0, Relaxed); // a later color does not change how `a` is freed
        heap.free(a, PAGE);
        assert_eq!(*heap.free.lock().unwrap(), vec![(0, 16 * PAGE)]);
    }

    #[test]
    fn a_growing_host_vec_moves_out_with_its_elements() {
        let _one = HEAP_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        made();
        let mut v = host_vec(1000, 7u32);
        assert!(in_shared_heap(&v));
        v.push(8);
        assert!(!in_shared_heap(&v), "a reallocation goes to the system allocator");
        assert_eq!(v.len(), 1001);
        assert!(v[..1000].iter().all(|&x| x == 7) && v[1000] == 8);
    }

    #[test]
    fn a_peer_maps_the_same_memory() {
        let _one = HEAP_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let heap = made();
        let e = heap.exposure();
        assert_eq!(map_peer(e), Ok(heap.base()), "our own heap is not mapped twice");
        let v = host_vec(64, 0u64);
        let off = heap.offset_of(v.as_ptr().cast(), 512).unwrap();
        // The /proc path is what a peer opens: map it as a peer would and write through it.
        let peer = sys::map_peer(e.pid, e.fd, e.bytes).expect("the /proc path of our own memfd opens");
        assert_ne!(peer, heap.base(), "a second mapping");
        // SAFETY: `off` is inside both mappings of the same memfd.
        unsafe { peer.add(off).cast::<u64>().write_volatile(42) };
        assert_eq!(unsafe { std::ptr::read_volatile(v.as_ptr()) }, 42);
    }

    #[test]
    fn a_file_that_is_not_the_peers_heap_is_refused_unwritten() {
        use std::os::fd::AsRawFd;
        let _one = HEAP_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let e = made().exposure();
        // Our heap, but not the nonce the peer announced: someone else's heap.
        let err = map_peer(Exposure {
            nonce: e.nonce ^ 1,
            ..e
        })
        .unwrap_err();
        assert!(err.contains("is not that process's heap"), "{err}");
        // A file of ours under that pid and fd: never opened for writing.
        let path = std::env::temp_dir().join(format!("brigade-heap-test-{}", std::process::id()));
        let _scratch = crate::scratch::Scratch::absent(path.clone());
        std::fs::write(&path, [7u8; 64]).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let err = map_peer(Exposure {
            fd: file.as_raw_fd(),
            bytes: 4096,
            ..e
        })
        .unwrap_err();
        assert!(err.contains("not a heap"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), vec![7u8; 64]);
    }
}
