//! Every collective, dtype and op against a serial reference, world sizes 1..=8.

use crate::common;

use std::time::Duration;

use brigade_comm::{run_on_threads_with_timeout, Buffer, CommError, DType, ReduceOp};
use common::*;

const TIMEOUT: Duration = Duration::from_secs(20);
/// Element counts: empty, one, odd, and several MiB (4 MiB + 12 bytes in f32).
const SIZES: [usize; 4] = [0, 1, 1031, (1 << 20) + 3];

fn all_ok<R>(results: Vec<Result<R, CommError>>) -> Vec<R> {
    results
        .into_iter()
        .enumerate()
        .map(|(r, x)| x.unwrap_or_else(|e| panic!("rank {r}: {e}")))
        .collect()
}

/// `f(index, item)` of every item, in order, on two threads: the serial references are most
/// of these tests' time, and the ranks' threads wait for them.
fn on_two_threads<T: Sync, R: Send>(items: &[T], f: impl Fn(usize, &T) -> R + Sync) -> Vec<R> {
    let half = items.len() / 2;
    let f = &f;
    std::thread::scope(|s| {
        let first = s.spawn(move || {
            items[..half]
                .iter()
                .enumerate()
                .map(|(i, x)| f(i, x))
                .collect::<Vec<R>>()
        });
        let second: Vec<R> = items[half..].iter().enumerate().map(|(i, x)| f(half + i, x)).collect();
        let mut all = first.join().unwrap();
        all.extend(second);
        all
    })
}

#[test]
fn all_reduce_matches_serial_reference() {
    for world in 1..=8 {
        let cases: Vec<(DType, ReduceOp, usize)> = DTYPES
            .iter()
            .flat_map(|&d| OPS.iter().flat_map(move |&op| SIZES.iter().map(move |&n| (d, op, n))))
            .collect();
        let refs: Vec<Buffer> = on_two_threads(&cases, |salt, &(d, op, n)| {
            let inputs: Vec<Buffer> = (0..world).map(|r| input(d, r, n, salt)).collect();
            reference_reduce(&inputs, op)
        });
        all_ok(run_on_threads_with_timeout(world, TIMEOUT, |comm| {
            for (salt, &(d, op, n)) in cases.iter().enumerate() {
                let buf = input(d, comm.rank(), n, salt);
                let ptr = buf.as_ptr();
                let out = comm.all_reduce(buf, op, &format!("case {salt}")).wait().unwrap();
                let what = format!("world {world} rank {} all_reduce {op} {d} x {n}", comm.rank());
                assert_same(&out, &refs[salt], &what);
                if n > 0 {
                    assert_eq!(out.as_ptr(), ptr, "{what}: the buffer came back copied");
                }
            }
        }));
    }
}

#[test]
fn reduce_scatter_matches_serial_reference() {
    for world in 1..=8 {
        for (salt, &d) in DTYPES.iter().enumerate() {
            for (k, &op) in OPS.iter().enumerate() {
                // Chunk sizes 0, 1, odd and large (1 MiB of f32 per rank in total at most).
                for chunk in [0, 1, 333, (1 << 18) / world + 1] {
                    let salt = salt * 100 + k * 10 + chunk;
                    let n = chunk * world;
                    let inputs: Vec<Buffer> = (0..world).map(|r| input(d, r, n, salt)).collect();
                    let full = to_f32(&reference_reduce(&inputs, op));
                    all_ok(run_on_threads_with_timeout(world, TIMEOUT, |comm| {
                        let r = comm.rank();
                        let out = comm.reduce_scatter(inputs[r].clone(), op, "rs").wait().unwrap();
                        let want = from_f32(d, full[r * chunk..(r + 1) * chunk].to_vec());
                        assert_same(
                            &out,
                            &want,
                            &format!("world {world} rank {r} reduce_scatter {op} {d} chunk {chunk}"),
                        );
                    }));
                }
            }
        }
    }
}

#[test]
fn all_gather_and_broadcast_match_serial_reference() {
    for world in 1..=8 {
        let cases: Vec<(DType, usize, usize)> = DTYPES
            .iter()
            .chain([DType::U8, DType::I8].iter())
            .flat_map(|&d| {
                [0usize, 1, 1031, (1 << 19) + 1]
                    .into_iter()
                    .enumerate()
                    .map(move |(salt, n)| (d, salt, n))
            })
            .collect();
        let built = on_two_threads(&cases, |_, &(d, salt, n)| {
            let inputs: Vec<Buffer> = (0..world).map(|r| input(d, r, n, salt)).collect();
            let gathered = from_f32(d, inputs.iter().flat_map(to_f32).collect());
            (inputs, gathered)
        });
        for (&(d, _, n), (inputs, gathered)) in cases.iter().zip(built) {
            all_ok(run_on_threads_with_timeout(world, TIMEOUT, |comm| {
                let r = comm.rank();
                let what = format!("world {world} rank {r} {d} x {n}");
                let out = comm.all_gather(inputs[r].clone(), "ag").wait().unwrap();
                assert_same(&out, &gathered, &format!("{what} all_gather"));
                let roots: Vec<usize> = if n > 1000 {
                    vec![world - 1]
                } else {
                    (0..world).collect()
                };
                for root in roots {
                    let out = comm.broadcast(inputs[r].clone(), root, "bc").wait().unwrap();
                    assert_same(&out, &inputs[root], &format!("{what} broadcast root {root}"));
                }
            }));
        }
    }
}

#[test]
fn barrier_waits_for_every_rank() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    for world in 1..=8 {
        let arrived = AtomicUsize::new(0);
        all_ok(run_on_threads_with_timeout(world, TIMEOUT, |comm| {
            for round in 1..=3 {
                if comm.rank() == round % world {
                    std::thread::sleep(Duration::from_millis(20));
                }
                arrived.fetch_add(1, Ordering::SeqCst);
                comm.barrier(&format!("round {round}")).wait().unwrap();
                assert!(
                    arrived.load(Ordering::SeqCst) >= round * world,
                    "left barrier {round} early"
                );
            }
        }));
    }
}

#[test]
fn half_precision_sums_accumulate_in_f32() {
    // bf16 has 8 significant bits: 1 + 2^-9 rounds back to 1, so summing in bf16 would stay
    // at 1.0; with f32 accumulation 1 + 7 * 2^-9 rounds to 1.015625.
    let world = 8;
    let results = all_ok(run_on_threads_with_timeout(world, TIMEOUT, |comm| {
        let x = if comm.rank() == 0 { 1.0 } else { 2f32.powi(-9) };
        let bf = comm
            .all_reduce(from_f32(DType::BF16, vec![x]), ReduceOp::Sum, "bf16")
            .wait()
            .unwrap();
        let y = if comm.rank() == 0 { 2048.0 } else { 0.5 };
        let hf = comm
            .all_reduce(from_f32(DType::F16, vec![y]), ReduceOp::Sum, "f16")
            .wait()
            .unwrap();
        (to_f32(&bf)[0], to_f32(&hf)[0])
    }));
    for (bf, hf) in results {
        assert_eq!(bf, 1.015625);
        assert_eq!(hf, 2052.0); // f16 accumulation: 2048 + 0.5 rounds to 2048 seven times
    }
}

#[test]
fn reductions_on_bytes_are_unsupported_and_bad_arguments_are_rejected() {
    let results = all_ok(run_on_threads_with_timeout(3, TIMEOUT, |comm| {
        let u8_err = comm
            .all_reduce(Buffer::U8(vec![1; 4]), ReduceOp::Sum, "bytes")
            .wait()
            .unwrap_err();
        let i8_err = comm
            .reduce_scatter(Buffer::I8(vec![1; 6]), ReduceOp::Avg, "quantized")
            .wait()
            .unwrap_err();
        let rs_err = comm
            .reduce_scatter(Buffer::F32(vec![1.0; 4]), ReduceOp::Sum, "rs4")
            .wait()
            .unwrap_err();
        let bc_err = comm
            .broadcast(Buffer::F32(vec![1.0; 4]), 3, "root3")
            .wait()
            .unwrap_err();
        // The group still works afterwards.
        let ok = comm
            .all_reduce(Buffer::F32(vec![1.0; 4]), ReduceOp::Sum, "after")
            .wait()
            .unwrap();
        (u8_err, i8_err, rs_err, bc_err, ok)
    }));
    for (u8_err, i8_err, rs_err, bc_err, ok) in results {
        assert!(matches!(u8_err, CommError::Unsupported(_)), "{u8_err}");
        // integer payloads are not summed in their own type: the error says what to do instead
        assert!(
            matches!(i8_err, CommError::Unsupported(ref m) if m.contains("i8") && m.contains("all_gather_with_side") && m.contains("f32")),
            "{i8_err}"
        );
        assert!(
            matches!(rs_err, CommError::InvalidArgument(ref m) if m.contains("rs4")),
            "{rs_err}"
        );
        assert!(
            matches!(bc_err, CommError::InvalidArgument(ref m) if m.contains("root 3")),
            "{bc_err}"
        );
        assert_eq!(ok, Buffer::F32(vec![3.0; 4]));
    }
}

#[test]
fn max_propagates_a_nan_from_any_rank_as_torch_max_does() {
    // Element i is NaN on rank i % world only; element `world` is NaN nowhere. A NaN must win
    // whichever rank holds it (f32::max would drop it, or keep it depending on the order).
    for world in 1..=4 {
        for d in DTYPES {
            let len = world + 1;
            let results = all_ok(run_on_threads_with_timeout(world, TIMEOUT, |comm| {
                let rank = comm.rank();
                let mut xs: Vec<f32> = (0..len).map(|i| value(rank, i, 7)).collect();
                xs[rank] = f32::NAN;
                to_f32(&comm.all_reduce(from_f32(d, xs), ReduceOp::Max, "nan").wait().unwrap())
            }));
            let finite_max = (0..world).map(|r| value(r, world, 7)).fold(f32::NEG_INFINITY, f32::max);
            let finite_max = to_f32(&from_f32(d, vec![finite_max]))[0];
            for (rank, out) in results.iter().enumerate() {
                assert!(
                    out[..world].iter().all(|x| x.is_nan()),
                    "world {world} rank {rank} {d}: {out:?}"
                );
                assert_eq!(out[world], finite_max, "world {world} rank {rank} {d}: {out:?}");
            }
        }
    }
}

#[test]
fn a_side_buffer_travels_with_its_payload_in_one_all_gather() {
    // Each rank sends an int8 payload of 5 and 2 f32 scales; every rank gets every rank's both,
    // rank-major, and the all-gather is one collective of 5 + 8 bytes per rank.
    let world = 3;
    let recorder = brigade_comm::Recorder::new();
    let out = all_ok(run_on_threads_with_timeout(world, TIMEOUT, |comm| {
        let r = comm.rank() as i8;
        let comm = comm.traced(recorder.clone());
        let payload = Buffer::I8((0..5).map(|i| r * 10 + i - 20).collect());
        let side = Buffer::F32(vec![r as f32 + 0.5, -(r as f32)]);
        brigade_comm::all_gather_with_side(&comm, payload, side, "q")
            .wait()
            .unwrap()
    }));
    for (payloads, sides) in out {
        let want: Vec<i8> = (0..world as i8)
            .flat_map(|r| (0..5).map(move |i| r * 10 + i - 20))
            .collect();
        assert_eq!(payloads, Buffer::I8(want));
        assert_eq!(sides, Buffer::F32(vec![0.5, -0.0, 1.5, -1.0, 2.5, -2.0]));
    }
    let sent: Vec<_> = recorder
        .events()
        .into_iter()
        .filter(|e| e.track == brigade_comm::Track::Comm)
        .collect();
    assert_eq!(sent.len(), world, "one collective per rank");
    assert!(sent.iter().all(|e| e.op == "all_gather"), "{sent:?}");
    let payload: usize = sent.iter().map(|e| e.bytes).sum();
    assert_eq!(payload, world * (5 + 8));
    let wire: f64 = sent
        .iter()
        .map(|e| brigade_comm::RingOp::AllGather.wire_bytes(e.bytes as f64, world))
        .sum();
    assert_eq!(wire, (world * (world - 1) * (5 + 8)) as f64);
}

#[test]
fn buffers_round_trip_through_their_little_endian_bytes() {
    let wide = [Buffer::F64(vec![-1.5, 1e300]), Buffer::I64(vec![-3, 1 << 40])];
    let narrow = [DType::F32, DType::F16, DType::BF16, DType::U8, DType::I8].map(|d| input(d, 1, 9, 4));
    for b in narrow.iter().chain(&wide) {
        let d = b.dtype();
        assert_eq!(
            brigade_comm::buffer_from_le_bytes(d, &b.to_le_bytes()).as_ref(),
            Some(b),
            "{d}"
        );
    }
    assert_eq!(
        brigade_comm::buffer_from_le_bytes(DType::F32, &[0, 0, 0]),
        None,
        "not whole elements"
    );
    assert_eq!(
        brigade_comm::buffer_from_le_bytes(DType::I64, &[0; 12]),
        None,
        "not whole i64s"
    );
}
