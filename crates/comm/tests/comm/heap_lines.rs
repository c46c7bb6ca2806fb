//! The global allocator starts every block of a page or more on a cache line (a GEMM packs such
//! operands without split loads), through allocation, zeroed allocation and growth across the
//! threshold, and a block keeps its bytes when it grows or shrinks.

use brigade_comm::LINE_FROM_BYTES;

fn on_a_line<T>(v: &[T]) -> bool {
    v.as_ptr() as usize % 64 == 0
}

#[test]
fn blocks_of_a_page_or_more_start_on_a_cache_line_and_keep_their_bytes() {
    let floats = LINE_FROM_BYTES / 4;
    // sizes past the threshold, each held while the next is allocated (so the system cannot
    // hand back one lucky address every time)
    let mut held = vec![];
    for extra in 0..64 {
        let v: Vec<f32> = Vec::with_capacity(floats + extra * 3);
        assert!(on_a_line(&v), "{} bytes at {:p}", v.capacity() * 4, v.as_ptr());
        let z = vec![0u8; LINE_FROM_BYTES + extra * 5];
        assert!(on_a_line(&z), "{} zeroed bytes at {:p}", z.len(), z.as_ptr());
        held.push((v, z));
    }
    // a small block grown across the threshold and then shrunk below it keeps its bytes
    let mut g: Vec<u32> = (0..100).collect();
    g.reserve_exact(floats * 2);
    assert!(on_a_line(&g));
    g.extend(100..(floats as u32 * 2));
    assert!(on_a_line(&g));
    g.truncate(50);
    g.shrink_to_fit();
    assert_eq!(g, (0..50).collect::<Vec<u32>>());
    let mut h: Vec<u32> = (0..(floats as u32 * 2)).collect();
    h.truncate(10);
    h.shrink_to_fit();
    assert_eq!(h, (0..10).collect::<Vec<u32>>());
}
