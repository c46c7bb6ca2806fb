//! The overlap model on hand-built profiles whose answer is known, derived in the comments.

use std::time::Duration;

use brigade_comm::NetModel;
use brigade_ddp::overlap::{
    replay, replay_with, BucketOrder, BucketProfile, LaunchOverhead, LinkCost, ParamProfile, RankProfile, ReplayConfig,
    StepProfile, PROFILE_VERSION,
};

const MIB: usize = 1 << 20;

/// A link of 1 ms latency and 1 GiB/s: over 2 ranks an all-reduce of S bytes takes
/// 2·1 ms + S / 2^30 s (2(n−1)/n = 1).
fn link() -> NetModel {
    NetModel {
        latency: Duration::from_millis(1),
        bandwidth_bytes_per_s: (1u64 << 30) as f64,
    }
}

fn close(a: f64, b: f64, what: &str) {
    close_to(a, b, 1e-9, what)
}

fn close_to(a: f64, b: f64, rel: f64, what: &str) {
    assert!((a - b).abs() <= rel * b.abs().max(1e-3), "{what}: {a} vs {b}");
}

/// Two identical ranks: `params` as (bytes, ready time), backward compute ending at
/// `backward_end`, then 1 ms of optimizer.
fn profile(params: &[(usize, f64)], backward_end: f64) -> StepProfile {
    let rank = |r| RankProfile {
        rank: r,
        backward_start_s: 0.0,
        backward_end_s: backward_end,
        optimizer_start_s: backward_end,
        optimizer_end_s: backward_end + 0.001,
        step_end_s: backward_end + 0.001,
        grad_ready_s: params.iter().map(|p| p.1).collect(),
        buckets: vec![],
        gathers: vec![],
        control: vec![],
        policy_s: None,
    };
    StepProfile {
        version: PROFILE_VERSION,
        world_size: 2,
        bucket_cap_mb: 25.0,
        first_bucket_cap_mb: 1.0,
        activation_checkpointing: 0,
        policy: Some(brigade_ddp::overlap::ProfilePolicy {
            name: "allreduce".into(),
            wire: Some(brigade_ddp::overlap::WireModel::AllReduce { bytes_per_element: 4.0 }),
            after_step: None,
        }),
        run: None,
        params: params
            .iter()
            .enumerate()
            .map(|(i, p)| ParamProfile {
                name: format!("p{i}"),
                bytes: p.0,
                shape: vec![],
            })
            .collect(),
        ranks: vec![rank(0), rank(1)],
    }
}

fn cfg(cap_mb: f64, first_mb: f64) -> ReplayConfig {
    ReplayConfig {
        bucket_cap_mb: cap_mb,
        first_bucket_cap_mb: first_mb,
        link: LinkCost::Ring(link()),
        world_size: None,
        order: BucketOrder::Ready,
    }
}

#[test]
fn one_bucket_ready_at_the_end_is_exposed_whole() {
    // Both 1 MiB gradients are ready when backward ends (10 ms): one 2 MiB bucket starts then
    // and takes 2 ms + 2 MiB / 1 GiB/s = 2 ms + 1.953125 ms, all of it exposed.
    let p = profile(&[(MIB, 0.010), (MIB, 0.010)], 0.010);
    let r = replay(&p, &cfg(100.0, 100.0)).unwrap();
    let comm = 0.002 + 2.0 / 1024.0;
    assert_eq!(r.buckets.len(), 1);
    close(r.comm_s, comm, "comm");
    close(r.exposed_comm_s, comm, "exposed");
    close(r.buckets[0].exposed_s, comm, "bucket 0 exposed");
    close(r.compute_step_s, 0.011, "compute-only step");
    close(r.predicted_step_s, 0.011 + comm, "predicted step");
}

#[test]
fn buckets_that_finish_before_backward_ends_are_hidden() {
    // p1 (1 MiB) ready at 1 ms, p0 (1 MiB) at 4 ms, backward ends at 10 ms. With 1 MiB caps each
    // is its own bucket (ready order: p1 first): bucket 0 runs 1..3.977 ms, bucket 1 runs
    // 4..6.977 ms; both end before 10 ms, so nothing is exposed and the step is compute-only.
    let p = profile(&[(MIB, 0.004), (MIB, 0.001)], 0.010);
    let r = replay(&p, &cfg(1.0, 1.0)).unwrap();
    assert_eq!(
        r.buckets.iter().map(|b| b.params.clone()).collect::<Vec<_>>(),
        vec![vec![1], vec![0]]
    );
    let one = 0.002 + 1.0 / 1024.0;
    close(r.buckets[0].start_s, 0.001, "bucket 0 start");
    close(r.buckets[1].finish_s, 0.004 + one, "bucket 1 finish");
    assert_eq!(r.exposed_comm_s, 0.0);
    assert!(r.buckets.iter().all(|b| b.exposed_s == 0.0));
    close(r.predicted_step_s, r.compute_step_s, "predicted vs compute-only");
}

#[test]
fn a_comm_bound_step_queues_buckets_on_the_link() {
    // Four 64 MiB gradients ready at 1, 2, 3, 4 ms; each all-reduce takes 2 ms + 62.5 ms. The
    // link is the bottleneck: buckets run back to back from 1 ms, the last ends at
    // 1 ms + 4·64.5 ms = 259 ms; backward ended at 5 ms, so 254 ms are exposed.
    let g = 64 * MIB;
    let p = profile(&[(g, 0.004), (g, 0.003), (g, 0.002), (g, 0.001)], 0.005);
    let r = replay(&p, &cfg(1.0, 1.0)).unwrap();
    assert_eq!(r.buckets.len(), 4);
    for w in r.buckets.windows(2) {
        close(w[1].start_s, w[0].finish_s, "back to back");
    }
    close(r.exposed_comm_s, 0.001 + 4.0 * 0.0645 - 0.005, "exposed");
    // the lower bound drains the same bytes without latency: 1 ms + 4·62.5 ms − 5 ms
    close(r.lower_bound_exposed_s, 0.001 + 4.0 * 0.0625 - 0.005, "lower bound");
}

#[test]
fn strict_bucket_order_holds_back_a_bucket_that_filled_first() {
    // Reverse registration order makes p1 bucket 0 and p0 bucket 1. p0 is ready at 2 ms but
    // p1 only at 9 ms: bucket 1 is full first yet cannot launch before bucket 0 (9 ms), as on
    // every rank the collectives must be issued in the same order.
    let p = profile(&[(MIB, 0.002), (MIB, 0.009)], 0.010);
    let mut c = cfg(1.0, 1.0);
    c.order = BucketOrder::Reverse;
    let r = replay(&p, &c).unwrap();
    assert_eq!(r.buckets[0].params, vec![1]);
    assert_eq!(r.buckets[1].params, vec![0]);
    close(r.buckets[1].ready_s, 0.002, "bucket 1 ready");
    close(r.buckets[1].launch_s, 0.009, "bucket 1 launch waits for bucket 0");
    let one = 0.002 + 1.0 / 1024.0;
    close(
        r.buckets[1].start_s,
        0.009 + one,
        "bucket 1 starts when bucket 0 leaves the link",
    );
    // In ready order the early gradient goes first and the late one is exposed alone.
    let ready = replay(&p, &cfg(1.0, 1.0)).unwrap();
    assert!(
        ready.exposed_comm_s < r.exposed_comm_s,
        "{} vs {}",
        ready.exposed_comm_s,
        r.exposed_comm_s
    );
}

#[test]
fn the_slowest_rank_decides_when_a_bucket_starts() {
    // Rank 1 finishes p0 5 ms later than rank 0: the collective cannot start before it joins.
    let mut p = profile(&[(MIB, 0.004)], 0.010);
    p.ranks[1].grad_ready_s[0] = 0.009;
    let r = replay(&p, &cfg(25.0, 1.0)).unwrap();
    close(r.buckets[0].start_s, 0.009, "start");
}

#[test]
fn the_lower_bound_never_exceeds_any_caps_exposed_comm() {
    // Pseudo-random profiles (a fixed LCG): for every cap the bound holds.
    let mut x = 12345u64;
    let mut next = || {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (x >> 33) as f64 / (1u64 << 31) as f64
    };
    for _ in 0..50 {
        let params: Vec<(usize, f64)> = (0..12)
            .map(|_| ((next() * 8.0 * MIB as f64) as usize, next() * 0.02))
            .collect();
        let p = profile(&params, 0.02 + next() * 0.005);
        for cap in [0.25, 1.0, 5.0, 25.0, 100.0] {
            let r = replay(&p, &cfg(cap, cap.min(1.0))).unwrap();
            assert!(
                r.lower_bound_exposed_s <= r.exposed_comm_s + 1e-12,
                "cap {cap}: {} > {}",
                r.lower_bound_exposed_s,
                r.exposed_comm_s
            );
            assert!(r.predicted_step_s >= r.compute_step_s);
        }
    }
}

#[test]
fn the_lower_bound_holds_for_every_wire_model_at_any_world_size() {
    // A bucket's fixed costs (ZeRO's padding to a multiple of the ranks, an all-gather's
    // per-bucket header, top-k's rounding up of its entries) are paid once per bucket: the
    // bound charges every byte at the bandwidth as if the whole model were one bucket, which no
    // partition into buckets undercuts. Small parameters (16 bytes) beside large ones, at 2, 64
    // and 2^20 ranks.
    use brigade_ddp::overlap::WireModel;
    let wires = [
        WireModel::AllReduce { bytes_per_element: 4.0 },
        WireModel::ReduceScatter,
        WireModel::AllGather {
            bytes_per_element: 1.0,
            bytes_per_bucket: 4.0,
            density: 1.0,
        },
        WireModel::AllGather {
            bytes_per_element: 12.0,
            bytes_per_bucket: 8.0,
            density: 0.1,
        },
    ];
    let mut x = 777u64;
    let mut next = || {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (x >> 33) as f64 / (1u64 << 31) as f64
    };
    for _ in 0..8 {
        let params: Vec<(usize, f64)> = (0..10)
            .map(|i| (if i % 2 == 0 { 16 } else { 4 * (1 + (next() * 4096.0) as usize) }, next() * 0.02))
            .collect();
        let backward_end = 0.02 + next() * 0.005;
        for wire in &wires {
            let mut p = profile(&params, backward_end);
            p.policy.as_mut().unwrap().wire = Some(wire.clone());
            for world in [2, 64, 1 << 20] {
                for cap in [0.001, 1.0, 25.0] {
                    // no latency: the bound leaves it out, and at 2^20 ranks it would dwarf the rest
                    let mut c = cfg(cap, cap.min(1.0));
                    c.world_size = Some(world);
                    c.link = LinkCost::Ring(NetModel {
                        latency: Duration::ZERO,
                        ..link()
                    });
                    let r = replay(&p, &c).unwrap();
                    assert!(
                        r.lower_bound_exposed_s <= r.exposed_comm_s + 1e-12,
                        "{wire:?} at {world} ranks, cap {cap}: bound {} > exposed {}",
                        r.lower_bound_exposed_s,
                        r.exposed_comm_s
                    );
                }
            }
        }
    }
}

#[test]
fn a_measured_link_recovers_the_link_that_recorded_the_buckets() {
    // Buckets recorded on the 1 ms / 1 GiB/s link: fitting them gives back that link, so the
    // replay agrees with the ring model of the true link at any cap.
    let mut p = profile(&[(3 * MIB, 0.004), (MIB, 0.003), (MIB / 2, 0.002)], 0.010);
    let m = link();
    let recorded: Vec<BucketProfile> = [(vec![2], MIB / 2), (vec![1], MIB), (vec![0], 3 * MIB)]
        .into_iter()
        .map(|(params, bytes)| {
            let d = m.all_reduce_time(bytes, 2).as_secs_f64();
            BucketProfile {
                params,
                bytes,
                wire_bytes: None,
                ready_s: 0.0,
                launch_s: 0.0,
                issued_s: None,
                start_s: 0.0,
                finish_s: d,
                link_s: None,
            }
        })
        .collect();
    p.ranks[0].buckets = recorded;
    for cap in [0.5, 2.0, 100.0] {
        let truth = replay(&p, &cfg(cap, 1.0)).unwrap();
        let measured = replay(
            &p,
            &ReplayConfig {
                link: LinkCost::Measured,
                ..cfg(cap, 1.0)
            },
        )
        .unwrap();
        // (the recorded durations are whole nanoseconds, hence 1e-6)
        close_to(
            measured.predicted_step_s,
            truth.predicted_step_s,
            1e-6,
            &format!("cap {cap} step"),
        );
        close_to(
            measured.exposed_comm_s,
            truth.exposed_comm_s,
            1e-6,
            &format!("cap {cap} exposed"),
        );
    }
}

#[test]
fn another_world_size_is_costed_by_the_ring_formula() {
    // One 4 MiB bucket at the end of backward; over 8 ranks: 14·1 ms + 2·7/8 · 4 MiB / 1 GiB/s.
    let p = profile(&[(4 * MIB, 0.010)], 0.010);
    let r = replay(
        &p,
        &ReplayConfig {
            world_size: Some(8),
            ..cfg(25.0, 25.0)
        },
    )
    .unwrap();
    close(r.exposed_comm_s, 0.014 + 1.75 * 4.0 / 1024.0, "8 ranks");
    let one = replay(
        &p,
        &ReplayConfig {
            world_size: Some(1),
            ..cfg(25.0, 25.0)
        },
    )
    .unwrap();
    assert_eq!(one.exposed_comm_s, 0.0);
    close(one.predicted_step_s, one.compute_step_s, "one rank: no communication");
}

#[test]
fn bad_profiles_and_configs_are_errors_that_say_what_is_wrong() {
    let mut p = profile(&[(MIB, 0.004)], 0.010);
    p.version = 99;
    assert!(replay(&p, &cfg(25.0, 1.0))
        .unwrap_err()
        .to_string()
        .contains("version 99"));
    let mut p = profile(&[(MIB, 0.004)], 0.010);
    p.ranks[1].grad_ready_s.clear();
    assert!(replay(&p, &cfg(25.0, 1.0)).unwrap_err().to_string().contains("rank 1"));
    let p = profile(&[(MIB, 0.004)], 0.010);
    assert!(replay(&p, &cfg(0.0, 1.0))
        .unwrap_err()
        .to_string()
        .contains("bucket cap"));
    assert!(replay(
        &p,
        &ReplayConfig {
            link: LinkCost::Measured,
            ..cfg(25.0, 1.0)
        }
    )
    .unwrap_err()
    .to_string()
    .contains("no buckets"));
}

#[test]
fn inconsistent_profiles_are_errors_that_say_what_is_wrong() {
    let recorded_both = |p: &mut StepProfile| {
        for r in &mut p.ranks {
            r.buckets = vec![recorded(vec![0], MIB, 0.004, 0.005, 0.008)];
        }
    };
    let err = |p: &StepProfile| replay(p, &cfg(25.0, 1.0)).unwrap_err().to_string();
    let mut p = profile(&[(MIB, 0.004)], 0.010);
    recorded_both(&mut p);
    p.ranks[0].buckets[0].finish_s = 1e308;
    assert!(err(&p).contains("past 1000000 s"), "{}", err(&p));
    // a time far out of range is printed in exponent form, not in hundreds of digits
    assert!(err(&p).contains("finish_s is 1e308:"), "{}", err(&p));
    recorded_both(&mut p);
    let end = p.ranks[0].step_end_s;
    p.ranks[0].step_end_s = 1e300;
    assert!(err(&p).contains("rank 0: step_end_s is 1e300:"), "{}", err(&p));
    p.ranks[0].step_end_s = -2.5e-12;
    assert!(err(&p).contains("step_end_s is -2.5e-12:"), "{}", err(&p));
    p.ranks[0].step_end_s = -0.5;
    assert!(err(&p).contains("step_end_s is -0.5:"), "{}", err(&p));
    p.ranks[0].step_end_s = end;
    recorded_both(&mut p);
    p.ranks[0].buckets[0].finish_s = 0.001;
    assert!(err(&p).contains("finishes before it starts"), "{}", err(&p));
    recorded_both(&mut p);
    p.ranks[1].buckets[0].bytes = 7;
    assert!(err(&p).contains("bucket 0 says 7 bytes"), "{}", err(&p));
    recorded_both(&mut p);
    p.ranks[1].buckets.push(recorded(vec![], 0, 0.009, 0.009, 0.009));
    assert!(err(&p).contains("differ from rank 0's"), "{}", err(&p));
    recorded_both(&mut p);
    p.params[0].bytes = usize::MAX;
    assert!(err(&p).contains("more than"), "{}", err(&p));
}

#[test]
fn profiles_round_trip_through_json() {
    let p = profile(&[(MIB, 0.004), (16, 0.001)], 0.010);
    let text = serde_json::to_string(&p).unwrap();
    let back: StepProfile = serde_json::from_str(&text).unwrap();
    assert_eq!(back, p);
}

#[test]
fn what_followed_the_recorded_buckets_is_kept_as_recorded() {
    // Both 1 MiB gradients ready when backward ends (10 ms). The recorded step waited for its
    // buckets until 12 ms, then spent 1 ms agreeing on the loss before a 1 ms optimizer (13..14).
    // Replayed at 100 MiB: one bucket 10..13.953125 ms, then the same 1 ms gap and 1 ms
    // optimizer: 15.953125 ms; without communication: 10 + 1 + 1 = 12 ms.
    let mut p = profile(&[(MIB, 0.010), (MIB, 0.010)], 0.010);
    for r in &mut p.ranks {
        r.buckets = vec![BucketProfile {
            params: vec![1, 0],
            bytes: 2 * MIB,
            wire_bytes: None,
            ready_s: 0.010,
            launch_s: 0.010,
            issued_s: None,
            start_s: 0.010,
            finish_s: 0.012,
            link_s: None,
        }];
        (r.optimizer_start_s, r.optimizer_end_s, r.step_end_s) = (0.013, 0.014, 0.014);
    }
    let r = replay(&p, &cfg(100.0, 100.0)).unwrap();
    let comm = 0.002 + 2.0 / 1024.0;
    close(r.predicted_step_s, 0.010 + comm + 0.002, "predicted step");
    close(r.compute_step_s, 0.012, "compute-only step");
}

/// One recorded bucket of `params` (`bytes`), issued at `ready`, on the link `start..finish`.
fn recorded(params: Vec<usize>, bytes: usize, ready: f64, start: f64, finish: f64) -> BucketProfile {
    BucketProfile {
        params,
        bytes,
        wire_bytes: None,
        ready_s: ready,
        launch_s: ready,
        issued_s: None,
        start_s: start,
        finish_s: finish,
        link_s: None,
    }
}

#[test]
fn ranks_whose_steps_started_apart_are_put_on_one_clock() {
    // Every rank stamps times from its own step's start. Rank 1 started this step 5 ms before
    // rank 0, so its stamps are 5 ms larger for the same instants, its buckets' starts too
    // (a collective starts at one instant on every rank). On rank 0's clock both ranks have p1
    // ready at 2 ms and p0 at 6 ms, backward ending at 10 ms: the replay must not see rank 1 as
    // 5 ms late. Bucket 0 (p1) runs 2..4.977 ms, bucket 1 (p0) 6..8.977 ms, nothing exposed.
    let mut p = profile(&[(MIB, 0.006), (MIB, 0.002)], 0.010);
    let one = 0.002 + 1.0 / 1024.0;
    let shifted = |r: &mut RankProfile, by: f64| {
        r.buckets = vec![
            recorded(vec![1], MIB, 0.002 + by, 0.002 + by, 0.002 + one + by),
            recorded(vec![0], MIB, 0.006 + by, 0.006 + by, 0.006 + one + by),
        ];
        r.backward_end_s += by;
        r.optimizer_start_s += by;
        r.optimizer_end_s += by;
        r.step_end_s += by;
        r.grad_ready_s.iter_mut().for_each(|t| *t += by);
    };
    shifted(&mut p.ranks[0], 0.0);
    shifted(&mut p.ranks[1], 0.005);
    let offsets = p.clock_offsets();
    close(offsets[0], 0.0, "rank 0's offset");
    close(offsets[1], 0.005, "rank 1's offset");
    let r = replay(&p, &cfg(1.0, 1.0)).unwrap();
    close(r.buckets[0].start_s, 0.002, "bucket 0 start on rank 0's clock");
    close(r.buckets[1].finish_s, 0.006 + one, "bucket 1 finish");
    assert_eq!(r.exposed_comm_s, 0.0);
    // Each rank's step on its own clock (rank 0: 11 ms, rank 1: 16 ms); the group's step, which
    // every rank takes on average once they meet at each step's buckets, is their mean.
    close(r.compute_step_s, 0.0135, "compute-only step");
    close(r.predicted_step_s, 0.0135, "predicted step");
}

/// The profile of [`the_launch_overhead_is_fitted_from_buckets_that_found_the_link_idle`]:
/// bucket [1] brought in 4 ms while backward computes, bucket [0] in 1 ms after it.
fn two_regimes() -> StepProfile {
    let g = 16 * MIB;
    let mut p = profile(&[(g, 0.030), (g, 0.005)], 0.030);
    let run = 0.002 + 16.0 / 1024.0;
    for r in &mut p.ranks {
        r.buckets = vec![
            recorded(vec![1], g, 0.005, 0.009, 0.009 + run),
            recorded(vec![0], g, 0.030, 0.031, 0.031 + run),
        ];
        (r.optimizer_start_s, r.optimizer_end_s, r.step_end_s) = (0.031 + run, 0.032 + run, 0.032 + run);
    }
    p
}

#[test]
fn one_overhead_is_fitted_from_every_profile_of_a_sweep() {
    // One profile recorded only the bucket brought during backward (a small cap's), another
    // only the one brought after (a large cap's). Alone, the first borrows its 4 ms per 16 MiB
    // for after backward too; fitted together they give each regime its own.
    let (mut small, mut large) = (two_regimes(), two_regimes());
    for r in &mut small.ranks {
        r.buckets.truncate(1);
    }
    for r in &mut large.ranks {
        r.buckets.remove(0);
    }
    let per_16mib = |c: brigade_ddp::overlap::LaunchCost| c.per_byte_s * (16 * MIB) as f64;
    let alone = LaunchOverhead::fit(&[&small]);
    close(per_16mib(alone.after_backward), 0.004, "borrowed");
    let both = LaunchOverhead::fit(&[&small, &large]);
    close(per_16mib(both.during_backward), 0.004, "during backward");
    close(per_16mib(both.after_backward), 0.001, "after backward");
    // The small cap's profile replayed at 100 MiB: one 32 MiB bucket brought after backward.
    let body = 0.002 + 32.0 / 1024.0;
    let r = replay_with(&small, &cfg(100.0, 100.0), both).unwrap();
    close(r.exposed_comm_s, 0.002 + body, "with the sweep's overhead");
    let r = replay(&small, &cfg(100.0, 100.0)).unwrap();
    close(r.exposed_comm_s, 0.008 + body, "with its own");
}

#[test]
fn the_launch_overhead_is_fitted_from_buckets_that_found_the_link_idle() {
    // Two 16 MiB gradients: p1 ready at 5 ms, p0 when backward ends at 30 ms. Recorded with
    // 16 MiB caps (one bucket each): bucket [1] issued at 5 ms started on the idle link at 9 ms
    // (4 ms to bring 16 MiB while backward computes: the reduction shares the cores), ran
    // 2 ms + 16 MiB / 1 GiB/s = 17.625 ms; bucket [0], issued at 30 ms, started at 31 ms (1 ms
    // once backward is over).
    let (g, run) = (16 * MIB, 0.002 + 16.0 / 1024.0);
    let p = two_regimes();
    // At the recorded caps the replay gives back what ran.
    let same = replay(&p, &cfg(16.0, 16.0)).unwrap();
    let o = same.launch_overhead;
    close(
        o.during_backward.per_byte_s * g as f64,
        0.004,
        "during backward, 16 MiB",
    );
    close(o.after_backward.per_byte_s * g as f64, 0.001, "after backward, 16 MiB");
    close(same.buckets[0].start_s, 0.009, "bucket 0 start");
    close(same.buckets[1].start_s, 0.031, "bucket 1 start");
    close(same.exposed_comm_s, 0.001 + run, "exposed as recorded");
    close(same.predicted_step_s, 0.032 + run, "step as recorded");
    // One 32 MiB bucket, issued when backward ends: brought at the after-backward rate (2 ms),
    // then 2 ms + 31.25 ms on the link, all of it exposed.
    let one = replay(&p, &cfg(100.0, 100.0)).unwrap();
    assert_eq!(one.buckets.len(), 1);
    close(one.buckets[0].start_s, 0.032, "one bucket's start");
    close(one.exposed_comm_s, 0.002 + 0.002 + 32.0 / 1024.0, "one bucket exposed");
}

/// `profile` recorded under `policy` with `wire`, its parameters' shapes given.
fn under(
    mut p: StepProfile,
    policy: &str,
    wire: Option<brigade_ddp::overlap::WireModel>,
    shapes: &[&[usize]],
) -> StepProfile {
    p.policy = Some(brigade_ddp::overlap::ProfilePolicy {
        name: policy.into(),
        wire,
        after_step: None,
    });
    for (param, s) in p.params.iter_mut().zip(shapes) {
        param.shape = s.to_vec();
    }
    p
}

#[test]
fn the_replay_costs_each_policys_own_collectives() {
    use brigade_ddp::overlap::WireModel;
    // Two gradients ready when backward ends (10 ms), one bucket, 2 ranks on the 1 ms, 1 GiB/s
    // link: a matrix [512, 256] (512 KiB in f32) and a bias [256] (1 KiB).
    let (w, b) = (512 * 256 * 4, 256 * 4);
    let base = profile(&[(w, 0.010), (b, 0.010)], 0.010);
    let shapes: [&[usize]; 2] = [&[512, 256], &[256]];
    let one = |p: &StepProfile| {
        let r = replay(p, &cfg(100.0, 100.0)).unwrap();
        assert_eq!(r.buckets.len(), 1);
        (r.policy.clone(), r.comm_s, r.buckets[0].wire_bytes)
    };
    let gib = (1u64 << 30) as f64;
    let s = (w + b) as f64;
    // f32 all-reduce (a profile that names no policy): 2 ms + S/B, and S on the wire (2(n-1)/n = 1)
    let (name, t, sent) = one(&base);
    assert_eq!(name, "allreduce");
    close(t, 0.002 + s / gib, "allreduce");
    close(sent, s, "allreduce bytes");
    // fp16: the same latencies, half the bytes
    let fp16 = under(
        base.clone(),
        "fp16",
        Some(WireModel::AllReduce { bytes_per_element: 2.0 }),
        &shapes,
    );
    let (name, t, sent) = one(&fp16);
    assert_eq!(name, "fp16");
    close(t, 0.002 + s / 2.0 / gib, "fp16");
    close(sent, s / 2.0, "fp16 bytes");
    // ZeRO: one reduce-scatter of the bucket padded to the ranks: (n-1) = 1 latency and
    // (n-1)/n = half the bytes (the 65792 elements divide by 2: no padding)
    let zero = under(base.clone(), "zero1", Some(WireModel::ReduceScatter), &shapes);
    let (_, t, sent) = one(&zero);
    close(t, 0.001 + s / 2.0 / gib, "zero1");
    close(sent, s / 2.0, "zero1 bytes");
    // PowerSGD rank 4: the matrix as P [512 x 4] and Q [256 x 4] (f32), the bias whole: two
    // all-reduces (the bias with P, then Q), twice the latency, (512 + 256)·4·4 + 1024 bytes
    let psgd = under(
        base.clone(),
        "powersgd:4",
        Some(WireModel::LowRank {
            start_iter: 10,
            factors: vec![Some((512 * 4, 256 * 4)), None],
        }),
        &shapes,
    );
    let (p_bytes, q_bytes, plain) = (512.0 * 4.0 * 4.0, 256.0 * 4.0 * 4.0, b as f64);
    let (_, t, sent) = one(&psgd);
    close(t, 2.0 * 0.002 + (p_bytes + q_bytes + plain) / gib, "powersgd");
    close(sent, p_bytes + q_bytes + plain, "powersgd bytes");
    // top-k 1%: one all-gather of ceil(0.01 x 131328) = 1314 entries of 12 bytes and an 8-byte
    // count from each rank: (n-1) latencies, and (n-1) pieces over the link: it grows with the
    // ranks where an all-reduce's bytes do not
    let topk = under(
        base.clone(),
        "topk:0.01",
        Some(WireModel::AllGather {
            bytes_per_element: 12.0,
            bytes_per_bucket: 8.0,
            density: 0.01,
        }),
        &shapes,
    );
    let piece = 1314.0 * 12.0 + 8.0;
    let (name, t, sent) = one(&topk);
    assert_eq!(name, "topk:0.01");
    close(t, 0.001 + piece / gib, "topk");
    close(sent, piece, "topk bytes");
    let at4 = replay(
        &topk,
        &ReplayConfig {
            world_size: Some(4),
            ..cfg(100.0, 100.0)
        },
    )
    .unwrap();
    close(at4.comm_s, 3.0 * 0.001 + 3.0 * piece / gib, "topk at 4 ranks");
    close(at4.buckets[0].wire_bytes, 3.0 * piece, "topk bytes at 4 ranks");
    // a user policy that declared no model is refused in one line naming it
    let user = under(base, "int8-ef", None, &shapes);
    let e = replay(&user, &cfg(100.0, 100.0)).unwrap_err().to_string();
    assert!(
        e.contains("'int8-ef'") && e.contains("wire model") && !e.contains('\n'),
        "{e}"
    );
}

#[test]
fn a_measured_link_is_fitted_to_what_each_recorded_bucket_sent() {
    use brigade_ddp::overlap::WireModel;
    // Two buckets recorded under fp16 on 2 ranks: 1 MiB and 3 MiB of gradients sent as 0.5 and
    // 1.5 MiB, taking 2 ms + 0.5 ms and 2 ms + 1.5 ms (1 ms latency, 1 GiB/s). Fitted to what
    // was sent, the link is the one of the f32 test: replayed as fp16 it predicts those times.
    let mut p = under(
        profile(&[(MIB, 0.002), (3 * MIB, 0.010)], 0.010),
        "fp16",
        Some(WireModel::AllReduce { bytes_per_element: 2.0 }),
        &[&[MIB / 4], &[3 * MIB / 4]],
    );
    let bucket = |params: Vec<usize>, bytes: usize, start: f64, secs: f64| BucketProfile {
        params,
        bytes,
        wire_bytes: Some(bytes as f64 / 2.0),
        ready_s: start,
        launch_s: start,
        issued_s: None,
        start_s: start,
        finish_s: start + secs,
        link_s: None,
    };
    for r in &mut p.ranks {
        r.buckets = vec![
            bucket(vec![0], MIB, 0.002, 0.002 + 0.5 / 1024.0),
            bucket(vec![1], 3 * MIB, 0.010, 0.002 + 1.5 / 1024.0),
        ];
    }
    let measured = ReplayConfig {
        link: LinkCost::Measured,
        ..cfg(1.0, 1.0)
    };
    let r = replay(&p, &measured).unwrap();
    close_to(
        r.buckets[0].finish_s - r.buckets[0].start_s,
        0.002 + 0.5 / 1024.0,
        1e-6,
        "bucket 0",
    );
    close_to(
        r.buckets[1].finish_s - r.buckets[1].start_s,
        0.002 + 1.5 / 1024.0,
        1e-6,
        "bucket 1",
    );
}

/// ZeRO-3 on two identical ranks: one unit `u` of one 1 MiB parameter. Its forward gather is
/// issued and needed at 0 and finishes at 2 ms; the forward computes until 5 ms, where backward
/// gathers `u` again (needed at once, finished at 7 ms); the gradient is ready at 10 ms, when
/// backward ends, and its reduce-scatter runs 10–12 ms; the optimizer runs 12–13 ms.
fn zero3_profile() -> StepProfile {
    use brigade_ddp::overlap::{GatherProfile, WireModel};
    use brigade_ddp::policy::GatherPhase;
    let mut p = under(
        profile(&[(MIB, 0.010)], 0.010),
        "zero3",
        Some(WireModel::Zero3 {
            quantized_gradients: None,
            quantized_gathers: None,
        }),
        &[&[MIB / 4]],
    );
    let gather = |phase, at: f64| GatherProfile {
        unit: "u".into(),
        bytes: MIB,
        phase,
        issued_s: at,
        needed_s: Some(at),
        start_s: at,
        finish_s: at + 0.002,
    };
    for r in &mut p.ranks {
        r.backward_start_s = 0.005;
        r.optimizer_start_s = 0.012;
        r.optimizer_end_s = 0.013;
        r.step_end_s = 0.013;
        r.buckets = vec![BucketProfile {
            params: vec![0],
            bytes: MIB,
            wire_bytes: Some(MIB as f64 / 2.0),
            ready_s: 0.010,
            launch_s: 0.010,
            issued_s: None,
            start_s: 0.010,
            finish_s: 0.012,
            link_s: None,
        }];
        r.gathers = vec![gather(GatherPhase::Forward, 0.0), gather(GatherPhase::Backward, 0.005)];
    }
    p
}

#[test]
fn a_zero3_step_replays_its_gathers_and_moves_the_compute_that_waits_for_them() {
    let p = zero3_profile();
    assert!((p.gather_waited_s() - 0.004).abs() < 1e-12);
    let at = |link: NetModel| {
        let c = ReplayConfig {
            link: LinkCost::Ring(link),
            ..cfg(25.0, 1.0)
        };
        replay_with(&p, &c, LaunchOverhead::default()).unwrap()
    };
    // On the link the step had (1 ms + 0.5 MiB / B = 2 ms: B = 500 MiB/s) the replay is the
    // recorded step: 13 ms, 4 ms of it waiting for the gathers.
    let recorded = at(NetModel {
        latency: Duration::from_millis(1),
        bandwidth_bytes_per_s: (500 * MIB) as f64,
    });
    close(recorded.predicted_step_s, 0.013, "the recorded step");
    close(recorded.exposed_gather_s, 0.004, "the recorded wait");
    close(recorded.compute_step_s, 0.007, "the step without communication");
    assert_eq!(recorded.gathers.len(), 2);
    // On the 1 ms, 1 GiB/s link each collective takes g = 1 ms + 0.5 MiB / 1 GiB/s. The forward
    // waits g (not 2 ms), so backward reaches `u` at 3 ms + g, waits g, the gradient is ready at
    // 6 ms + 2g and its reduce-scatter finishes at 6 ms + 3g: the step is 7 ms + 3g. With the
    // gathers left out it would be the recorded compute plus the bucket: 11 ms + g.
    let g = 0.001 + 0.5 / 1024.0;
    let fast = at(link());
    close(fast.exposed_gather_s, 2.0 * g, "the wait on the faster link");
    close(fast.gathers[1].issued_s, 0.003 + g, "backward's gather");
    close(fast.buckets[0].finish_s, 0.006 + 3.0 * g, "the bucket");
    close(fast.predicted_step_s, 0.007 + 3.0 * g, "the step on the faster link");
    // a slower link: a longer step, more of it waiting for the gathers
    let slow = at(NetModel {
        latency: Duration::from_millis(1),
        bandwidth_bytes_per_s: (64 * MIB) as f64,
    });
    assert!(slow.predicted_step_s > recorded.predicted_step_s);
    assert!(slow.exposed_gather_s > recorded.exposed_gather_s);
}

#[test]
fn a_policy_that_syncs_after_the_step_is_charged_its_share_of_each_sync() {
    use brigade_ddp::overlap::WireModel;
    use brigade_ddp::policy::{AfterStepWire, WireOp};
    // The profile of `a_zero3_step_replays_its_gathers_and_its_units_buckets` (512 KiB + 1 KiB of f32 parameters, one bucket, 2 ranks on
    // the 1 ms, 1 GiB/s link), recorded under DiLoCo: no bucket traffic; every 10 steps one
    // all-reduce of every parameter (2 ms + S/B), a tenth of it on each step.
    let (w, b) = (512 * 256 * 4, 256 * 4);
    let base = profile(&[(w, 0.010), (b, 0.010)], 0.010);
    let shapes: [&[usize]; 2] = [&[512, 256], &[256]];
    let gib = (1u64 << 30) as f64;
    let s = (w + b) as f64;
    let diloco = |every, fragments, overlap_steps| {
        let mut p = under(base.clone(), "diloco", Some(WireModel::Local), &shapes);
        p.policy.as_mut().unwrap().after_step = Some(AfterStepWire {
            op: WireOp::AllReduce,
            bytes_per_element: 4.0,
            every,
            fragments,
            overlap_steps,
            collectives: 1,
            parts: vec![],
        });
        p
    };
    let after =
        |every, fragments, overlap_steps| replay(&diloco(every, fragments, overlap_steps), &cfg(100.0, 100.0)).unwrap();
    let r = after(10, 1, 0);
    assert_eq!(r.buckets.len(), 1);
    close(r.buckets[0].wire_bytes, 0.0, "nothing in backward");
    close(r.comm_s, 0.0, "no bucket on the link");
    let sync = 0.002 + s / gib;
    close(
        r.predicted_step_s - r.compute_step_s,
        sync / 10.0,
        "a tenth of a sync a step",
    );
    close(r.after_step_comm_s, sync / 10.0, "reported as the after-step share");
    // two fragments, each synced once a period and waited for at once: two latencies
    let r2 = after(10, 2, 0);
    close(
        r2.predicted_step_s - r2.compute_step_s,
        2.0 * (0.002 + s / 2.0 / gib) / 10.0,
        "two fragments",
    );
    // overlapping a step's compute (over 10 ms) hides each fragment's sync (about 2.25 ms)
    let hidden = after(10, 2, 1);
    close(
        hidden.predicted_step_s - hidden.compute_step_s,
        0.0,
        "hidden behind the next step",
    );
    // a period of 0 is refused in one line
    let e = replay(&diloco(0, 1, 0), &cfg(100.0, 100.0)).unwrap_err().to_string();
    assert!(e.contains("every 0 steps") && !e.contains('\n'), "{e}");
}

/// The profile of the DiLoCo test (512 KiB + 1 KiB of f32 parameters, backward's compute
/// ending at 10 ms, 2 ranks) under streaming DiLoCo on a 32 MiB/s, 1 ms link: two fragments
/// sent every 10 steps, each behind the compute that follows it, of `parts` (empty: equal).
fn streaming(parts: Vec<brigade_ddp::policy::FragmentPart>) -> (StepProfile, ReplayConfig) {
    use brigade_ddp::overlap::WireModel;
    use brigade_ddp::policy::{AfterStepWire, WireOp};
    let (w, b) = (512 * 256 * 4, 256 * 4);
    let shapes: [&[usize]; 2] = [&[512, 256], &[256]];
    let mut p = under(
        profile(&[(w, 0.010), (b, 0.010)], 0.010),
        "streaming",
        Some(WireModel::Local),
        &shapes,
    );
    p.policy.as_mut().unwrap().after_step = Some(AfterStepWire {
        op: WireOp::AllReduce,
        bytes_per_element: 4.0,
        every: 10,
        fragments: 2,
        overlap_steps: 1,
        collectives: 1,
        parts,
    });
    let slow = ReplayConfig {
        link: LinkCost::Ring(NetModel {
            latency: Duration::from_millis(1),
            bandwidth_bytes_per_s: (32 * MIB) as f64,
        }),
        ..cfg(100.0, 100.0)
    };
    (p, slow)
}

#[test]
fn each_fragment_of_an_after_step_sync_is_priced_at_its_own_share() {
    use brigade_ddp::policy::FragmentPart;
    // The first fragment holds the 512 KiB weight, the second the 1 KiB bias. Each runs behind
    // the 10 ms of backward's compute of the step after it (the ranks' agreement then queues
    // behind it): the weight's all-reduce (2 ms + 512 KiB at 32 MiB/s = 17.6 ms) is exposed
    // 7.6 ms once a period, the bias's (2.03 ms) not at all. Two equal halves (9.8 ms each)
    // would be hidden whole.
    let (w, b) = (512.0 * 256.0 * 4.0, 256.0 * 4.0);
    let parts = vec![
        FragmentPart {
            share: w / (w + b),
            collectives: 1,
        },
        FragmentPart {
            share: b / (w + b),
            collectives: 1,
        },
    ];
    let (p, slow) = streaming(parts);
    let r = replay(&p, &slow).unwrap();
    let weight = 0.002 + w / (32.0 * MIB as f64);
    close(
        r.after_step_comm_s,
        (weight - 0.010) / 10.0,
        "the weight's fragment exposed",
    );
    let (p, slow) = streaming(vec![]);
    let halves = replay(&p, &slow).unwrap();
    close(halves.after_step_comm_s, 0.0, "two equal halves");
}

#[test]
fn a_wait_behind_an_earlier_steps_sync_is_charged_as_the_syncs_priced_share() {
    // The recorded step's agreement after backward (10 ms) queued behind a fragment sync that
    // an earlier step issued and that left the comm stream at 19 ms: the optimizer began at
    // 20 ms. Replayed, the 9 ms of waiting leave (the 1 ms agreement stays) and the syncs'
    // priced share comes in: the same on every step, whether its recorded step waited or not.
    let (quiet, slow) = streaming(vec![]);
    let mut waited = quiet.clone();
    for r in &mut waited.ranks {
        (r.optimizer_start_s, r.optimizer_end_s, r.step_end_s) = (0.020, 0.021, 0.021);
        r.policy_s = Some(brigade_ddp::overlap::PolicyTimes {
            in_flight_until_s: Some(0.019),
            ..Default::default()
        });
    }
    let (a, b) = (replay(&quiet, &slow).unwrap(), replay(&waited, &slow).unwrap());
    close(
        b.compute_step_s,
        a.compute_step_s + 0.001,
        "the agreement stays, the wait leaves",
    );
    close(b.predicted_step_s, a.predicted_step_s + 0.001, "the priced share alone");
    // Rank 1 reached the agreement 3 ms after rank 0: the sync left at 16 ms on its clock, its
    // optimizer began at 17 ms. Rank 0 would have waited those 3 ms for it in any step: each
    // rank's wait for the sync is the last rank's 6 ms, and rank 0 keeps 3 ms + 1 ms.
    let r1 = &mut waited.ranks[1];
    (r1.optimizer_start_s, r1.optimizer_end_s, r1.step_end_s) = (0.017, 0.018, 0.018);
    r1.policy_s.as_mut().unwrap().in_flight_until_s = Some(0.016);
    let c = replay(&waited, &slow).unwrap();
    close(
        c.compute_step_s,
        a.compute_step_s + (0.004 + 0.001) / 2.0,
        "rank 0 waited for rank 1",
    );
}

/// The profile of `what_followed_the_recorded_buckets_is_kept_as_recorded`: both 1 MiB
/// gradients ready at 10 ms, one recorded bucket on the comm stream 10..12 ms, 1 ms agreeing on
/// the loss, the optimizer 13..14 ms.
fn one_bucket_step() -> StepProfile {
    let mut p = profile(&[(MIB, 0.010), (MIB, 0.010)], 0.010);
    for r in &mut p.ranks {
        r.buckets = vec![recorded(vec![1, 0], 2 * MIB, 0.010, 0.010, 0.012)];
        (r.optimizer_start_s, r.optimizer_end_s, r.step_end_s) = (0.013, 0.014, 0.014);
    }
    p
}

#[test]
fn a_policys_compute_between_its_collectives_is_replayed_per_byte() {
    // The recorded bucket held the comm stream 2 ms, its collectives 1.5 ms of them: the policy
    // computed 0.5 ms for 2 MiB. Replayed in one bucket of the same 2 MiB on the ring: its
    // all-reduce (2 ms + 2 MiB / 1 GiB/s) and the 0.5 ms of compute, then as recorded.
    let mut p = one_bucket_step();
    for r in &mut p.ranks {
        r.buckets[0].link_s = Some(0.0015);
    }
    let r = replay(&p, &cfg(100.0, 100.0)).unwrap();
    let comm = 0.002 + 2.0 / 1024.0;
    close(r.policy_compute_s, 0.0005, "the policy's compute");
    close(r.predicted_step_s, 0.010 + comm + 0.0005 + 0.002, "predicted step");
    close(r.comm_s, comm + 0.0005, "the bucket's time on the comm stream");
}

#[test]
fn an_after_step_collective_is_priced_on_the_link_and_amortised_over_its_period() {
    // The policy all-reduces every parameter in f32 every 4 steps after the optimizer; the
    // recorded step's optimizer span (1 ms) held 0.4 ms of it. Replayed: that 0.4 ms leaves,
    // and a quarter of the all-reduce of 2 MiB on the ring (2 ms + 2 MiB / 1 GiB/s) comes in.
    let mut p = one_bucket_step();
    p.policy.as_mut().unwrap().after_step = Some(brigade_ddp::policy::AfterStepWire {
        op: brigade_ddp::policy::WireOp::AllReduce,
        bytes_per_element: 4.0,
        every: 4,
        fragments: 1,
        overlap_steps: 0,
        collectives: 1,
        parts: vec![],
    });
    for r in &mut p.ranks {
        r.policy_s = Some(brigade_ddp::overlap::PolicyTimes {
            reduce_s: 0.0,
            after_step_s: 0.0005,
            after_step_link_s: 0.0004,
            in_flight_until_s: None,
        });
    }
    let r = replay(&p, &cfg(100.0, 100.0)).unwrap();
    let comm = 0.002 + 2.0 / 1024.0;
    let after = comm / 4.0;
    close(
        r.after_step_comm_s,
        after,
        "a step's share of the after-step all-reduce",
    );
    close(
        r.predicted_step_s,
        0.010 + comm + 0.001 + (0.001 - 0.0004) + after,
        "predicted step",
    );
    // at 4 ranks the all-reduce waits 2·3 latencies and sends 2·3/4 of its buffer
    let at4 = replay(
        &p,
        &ReplayConfig {
            world_size: Some(4),
            ..cfg(100.0, 100.0)
        },
    )
    .unwrap();
    close(at4.after_step_comm_s, (0.006 + 1.5 * 2.0 / 1024.0) / 4.0, "at 4 ranks");
}

#[test]
fn the_steps_own_collectives_separate_the_latency_from_the_bytes_of_one_sync() {
    // A policy that sends nothing with its buckets and all-reduces its 2 MiB after the step
    // (a DiLoCo sync): on the 1 ms, 1 GiB/s link that all-reduce takes 2 ms + 2 MiB / 1 GiB/s,
    // and the ranks' agreement on the loss (12 bytes) 2 ms + 12 B / 1 GiB/s. The sync alone
    // cannot tell the latency from the bytes; with the agreement, the fit recovers both, and the
    // agreement of a step that did not sync is priced at its 2 ms, not at its bytes alone.
    use brigade_ddp::overlap::{ControlProfile, PolicyTimes, RingPrice, WireModel};
    use brigade_ddp::policy::{AfterStepWire, WireOp};
    let mut p = under(
        profile(&[(MIB, 0.010), (MIB, 0.010)], 0.010),
        "diloco:10",
        Some(WireModel::Local),
        &[&[MIB / 4], &[MIB / 4]],
    );
    p.policy.as_mut().unwrap().after_step = Some(AfterStepWire {
        op: WireOp::AllReduce,
        bytes_per_element: 4.0,
        every: 10,
        fragments: 1,
        overlap_steps: 0,
        collectives: 1,
        parts: vec![],
    });
    let (alpha, per_byte) = (0.001, 1.0 / (1u64 << 30) as f64);
    let sync = RingPrice::of(brigade_comm::RingOp::AllReduce, (2 * MIB) as f64, 2).seconds(alpha, per_byte);
    let agree = RingPrice::of(brigade_comm::RingOp::AllReduce, 12.0, 2).seconds(alpha, per_byte);
    close(sync, 0.002 + 2.0 / 1024.0, "the sync on the link");
    for r in &mut p.ranks {
        r.policy_s = Some(PolicyTimes {
            reduce_s: 0.0,
            after_step_s: sync + 0.0005,
            after_step_link_s: sync,
            in_flight_until_s: None,
        });
        r.control = vec![ControlProfile {
            op: WireOp::AllReduce,
            bytes: 12,
            link_s: agree,
            finish_s: None,
        }];
    }
    let link = brigade_ddp::overlap::measured_link(&[&p]).unwrap().unwrap();
    close_to(link.latency.as_secs_f64(), alpha, 1e-6, "the latency");
    close_to(1.0 / link.bandwidth_bytes_per_s, per_byte, 1e-6, "seconds per byte");
}

/// A PowerSGD profile on 2 ranks whose buckets were recorded on the 1 ms, 1 GiB/s link: a
/// matrix [512, 256] and its bias [256] in one bucket (two all-reduces: the bias with P
/// [512 x 4], then Q [256 x 4]), a matrix [256, 128] in another (two: P and Q). Each all-reduce
/// waits two latencies (2(n−1)), so each bucket took 4 ms besides its bytes.
fn powersgd_profile(start_iter: usize) -> StepProfile {
    use brigade_ddp::overlap::WireModel;
    let (w0, b0, w1) = (512 * 256 * 4, 256 * 4, 256 * 128 * 4);
    let mut p = under(
        profile(&[(w0, 0.010), (b0, 0.010), (w1, 0.004)], 0.010),
        "powersgd:4",
        Some(WireModel::LowRank {
            start_iter,
            factors: vec![Some((512 * 4, 256 * 4)), None, Some((256 * 4, 128 * 4))],
        }),
        &[&[512, 256], &[256], &[256, 128]],
    );
    let gib = (1u64 << 30) as f64;
    let (sent0, sent1) = ((512.0 + 256.0) * 16.0 + 1024.0, (256.0 + 128.0) * 16.0);
    let bucket = |params: Vec<usize>, bytes: usize, start: f64, sent: f64, secs: f64| BucketProfile {
        params,
        bytes,
        wire_bytes: Some(sent),
        ready_s: start,
        launch_s: start,
        issued_s: None,
        start_s: start,
        finish_s: start + secs,
        link_s: Some(secs),
    };
    for r in &mut p.ranks {
        r.buckets = vec![
            bucket(vec![2], w1, 0.004, sent1, 0.004 + sent1 / gib),
            bucket(vec![1, 0], w0 + b0, 0.010, sent0, 0.004 + sent0 / gib),
        ];
        (r.optimizer_start_s, r.optimizer_end_s, r.step_end_s) = (0.017, 0.018, 0.018);
    }
    p
}

#[test]
fn a_measured_link_charges_each_collective_of_a_bucket_its_latency() {
    // Fitted per collective, the link is the 1 ms, 1 GiB/s one the buckets were recorded on,
    // and the replay at the recorded caps gives back their times; a fit of one all-reduce per
    // bucket would find twice the latency (PowerSGD's two all-reduces a bucket).
    let p = powersgd_profile(1);
    let caps = ReplayConfig {
        order: BucketOrder::recorded(&p),
        ..cfg(0.1, 0.1)
    };
    let truth = replay(&p, &caps).unwrap();
    let measured = replay(
        &p,
        &ReplayConfig {
            link: LinkCost::Measured,
            ..caps
        },
    )
    .unwrap();
    assert_eq!(measured.buckets.len(), 2);
    for (m, t) in measured.buckets.iter().zip(&truth.buckets) {
        close_to(m.finish_s - m.start_s, t.finish_s - t.start_s, 1e-6, "a bucket's time");
    }
    close_to(
        truth.buckets[1].finish_s - truth.buckets[1].start_s,
        0.004 + ((512.0 + 256.0) * 16.0 + 1024.0) / (1u64 << 30) as f64,
        1e-6,
        "the two all-reduces on the true link",
    );
    close_to(measured.predicted_step_s, truth.predicted_step_s, 1e-6, "the step");
    // the link fitted from every profile of a list is the same link
    let link = brigade_ddp::overlap::measured_link(&[&p, &p]).unwrap().unwrap();
    close_to(link.latency.as_secs_f64(), 0.001, 1e-6, "latency");
    close_to(link.bandwidth_bytes_per_s, (1u64 << 30) as f64, 1e-6, "bandwidth");
}

#[test]
fn a_powersgd_step_before_its_start_step_is_priced_as_the_all_reduce_it_ran() {
    // The profile of `a_measured_link_charges_each_collective_of_a_bucket_its_latency`, recorded
    // at a step before PowerSGD's start: its buckets sent the gradients' bytes uncompressed.
    // Replayed on the true link in one bucket, that is one f32 all-reduce (2 ms + S/B), said so;
    // a step from the start on is the two all-reduces of the factors (the bias with the P's),
    // and says nothing.
    let mut p = powersgd_profile(10);
    for r in &mut p.ranks {
        for b in &mut r.buckets {
            b.wire_bytes = Some(b.bytes as f64);
        }
    }
    let r = replay(&p, &cfg(100.0, 100.0)).unwrap();
    let s: usize = p.params.iter().map(|q| q.bytes).sum();
    close(r.comm_s, 0.002 + s as f64 / (1u64 << 30) as f64, "a plain all-reduce");
    let note = r.wire_note.expect("a note saying how the step was priced");
    assert!(note.contains("start step (10)") && !note.contains('\n'), "{note}");
    let compressed = replay(&powersgd_profile(10), &cfg(100.0, 100.0)).unwrap();
    assert_eq!(compressed.wire_note, None);
    let factors = (512.0 + 256.0 + 256.0 + 128.0) * 16.0 + 1024.0;
    close(
        compressed.comm_s,
        0.004 + factors / (1u64 << 30) as f64,
        "two all-reduces",
    );
}

#[test]
fn a_measured_link_is_fitted_from_the_after_step_collectives_of_a_step_that_synced() {
    use brigade_ddp::overlap::{PolicyTimes, WireModel};
    use brigade_ddp::policy::{AfterStepWire, WireOp};
    // DiLoCo on 2 ranks: its bucket sends nothing in backward; the recorded step synced, its
    // optimizer span holding the all-reduce of every parameter on the 1 ms, 1 GiB/s link
    // (2 ms + S/B). Its one sample passes through that time: the step is charged a tenth of it,
    // as on the true link; fitted from the empty bucket alone, the link cost nothing.
    let (w, b) = (512 * 256 * 4, 256 * 4);
    let mut p = under(
        profile(&[(w, 0.010), (b, 0.010)], 0.010),
        "diloco:10",
        Some(WireModel::Local),
        &[&[512, 256], &[256]],
    );
    p.policy.as_mut().unwrap().after_step = Some(AfterStepWire {
        op: WireOp::AllReduce,
        bytes_per_element: 4.0,
        every: 10,
        fragments: 1,
        overlap_steps: 0,
        collectives: 1,
        parts: vec![],
    });
    let sync = 0.002 + (w + b) as f64 / (1u64 << 30) as f64;
    for r in &mut p.ranks {
        r.buckets = vec![recorded(vec![1, 0], w + b, 0.010, 0.010, 0.010)];
        (r.optimizer_start_s, r.optimizer_end_s, r.step_end_s) = (0.010, 0.011 + sync, 0.011 + sync);
        r.policy_s = Some(PolicyTimes {
            reduce_s: 0.0,
            after_step_s: sync,
            after_step_link_s: sync,
            in_flight_until_s: None,
        });
    }
    let measured = replay(
        &p,
        &ReplayConfig {
            link: LinkCost::Measured,
            ..cfg(100.0, 100.0)
        },
    )
    .unwrap();
    close_to(measured.after_step_comm_s, sync / 10.0, 1e-6, "a tenth of the sync");
    close_to(measured.predicted_step_s, 0.011 + sync / 10.0, 1e-6, "the step");
    // a step between syncs recorded nothing on the link: no link to measure, said in one line
    for r in &mut p.ranks {
        r.policy_s = None;
    }
    assert_eq!(brigade_ddp::overlap::measured_link(&[&p]).unwrap(), None);
    let measured = ReplayConfig {
        link: LinkCost::Measured,
        ..cfg(100.0, 100.0)
    };
    let e = replay(&p, &measured).unwrap_err().to_string();
    assert!(e.contains("no link to measure") && !e.contains('\n'), "{e}");
}

#[test]
fn a_policys_compute_after_its_collective_does_not_hold_the_link_for_the_next_bucket() {
    // Two 1 MiB gradients ready when backward ends (10 ms), one per bucket (1 MiB caps); the
    // recorded buckets spent 0.5 ms per MiB on the policy's compute besides their collectives
    // (converting the sum back, as fp16 does in the collective's continuation). The comm stream
    // runs bucket 0's all-reduce 10..12.977 ms (2 ms + 1 MiB / 1 GiB/s), its continuation
    // 12.977..13.477 ms beside the link, bucket 1's all-reduce from 12.977 ms to 15.953 ms and
    // its continuation to 16.453 ms; then the recorded 1 ms gap and 1 ms optimizer. Charging
    // the compute on the link would predict 0.5 ms more.
    let mut p = profile(&[(MIB, 0.010), (MIB, 0.010)], 0.010);
    for r in &mut p.ranks {
        let mut b0 = recorded(vec![1], MIB, 0.010, 0.010, 0.0125);
        b0.link_s = Some(0.002);
        let mut b1 = recorded(vec![0], MIB, 0.010, 0.012, 0.0145);
        b1.link_s = Some(0.002);
        r.buckets = vec![b0, b1];
        (r.optimizer_start_s, r.optimizer_end_s, r.step_end_s) = (0.0155, 0.0165, 0.0165);
    }
    let caps = ReplayConfig {
        order: BucketOrder::Reverse,
        ..cfg(1.0, 1.0)
    };
    let r = replay_with(&p, &caps, LaunchOverhead::default()).unwrap();
    assert_eq!(r.buckets.len(), 2);
    let link_s = 0.002 + 1.0 / 1024.0;
    close(
        r.buckets[1].start_s,
        0.010 + link_s,
        "bucket 1 takes the link when bucket 0's collective left it",
    );
    close(
        r.buckets[1].finish_s,
        0.010 + 2.0 * link_s + 0.0005,
        "bucket 1 with its compute",
    );
    close(r.policy_compute_s, 0.001, "the policy's compute");
    close(
        r.predicted_step_s,
        0.010 + 2.0 * link_s + 0.0005 + 0.002,
        "predicted step",
    );
}

#[test]
fn a_low_rank_bucket_waits_for_the_previous_buckets_compute_between_its_collectives() {
    // The profile of the test above under PowerSGD at rank 1 (a bucket's all-reduces of the P
    // and Q factors of its [512, 512] gradient, 2 KiB each, 2 ms of latency each): it issues
    // bucket 1's collectives once bucket 0's reduction, its compute included, is done. Bucket
    // 0 runs from 10 ms for 4 ms + 4 KiB on the link, then 0.5 ms of compute; bucket 1 only
    // then, and as long.
    use brigade_ddp::overlap::WireModel;
    let mut p = profile(&[(MIB, 0.010), (MIB, 0.010)], 0.010);
    for r in &mut p.ranks {
        let mut b0 = recorded(vec![1], MIB, 0.010, 0.010, 0.0125);
        b0.link_s = Some(0.002);
        let mut b1 = recorded(vec![0], MIB, 0.010, 0.0125, 0.015);
        b1.link_s = Some(0.002);
        r.buckets = vec![b0, b1];
        (r.optimizer_start_s, r.optimizer_end_s, r.step_end_s) = (0.016, 0.017, 0.017);
    }
    let shapes: [&[usize]; 2] = [&[512, 512], &[512, 512]];
    let low_rank = WireModel::LowRank {
        factors: vec![Some((512, 512)), Some((512, 512))],
        start_iter: 0,
    };
    let p = under(p, "powersgd:1", Some(low_rank), &shapes);
    let caps = ReplayConfig {
        order: BucketOrder::Reverse,
        ..cfg(1.0, 1.0)
    };
    let r = replay_with(&p, &caps, LaunchOverhead::default()).unwrap();
    let link_s = 0.004 + 4096.0 / (1u64 << 30) as f64;
    close(
        r.buckets[0].finish_s,
        0.010 + link_s + 0.0005,
        "bucket 0 with its compute",
    );
    close(
        r.buckets[1].start_s,
        0.010 + link_s + 0.0005,
        "bucket 1 once bucket 0 is done",
    );
    close(
        r.buckets[1].finish_s,
        0.010 + 2.0 * (link_s + 0.0005),
        "bucket 1 with its compute",
    );
}

/// The profile of the test above, its ranks computing unlike amounts between their collectives:
/// rank 0 0.5 ms in bucket 0 and 1 ms in bucket 1, rank 1 1.5 ms and 0.25 ms; each bucket's
/// collectives held the comm stream 2 ms.
fn unlike_ranks_under_powersgd() -> StepProfile {
    use brigade_ddp::overlap::WireModel;
    let mut p = profile(&[(MIB, 0.010), (MIB, 0.010)], 0.010);
    for (r, (c0, c1)) in p.ranks.iter_mut().zip([(0.0005, 0.001), (0.0015, 0.00025)]) {
        let mut b0 = recorded(vec![1], MIB, 0.010, 0.010, 0.012 + c0);
        b0.link_s = Some(0.002);
        // bucket 1's collectives began on both ranks once rank 1 was done with bucket 0
        let mut b1 = recorded(vec![0], MIB, 0.010, 0.0135, 0.0155 + c1);
        b1.link_s = Some(0.002);
        let waited = b1.finish_s;
        r.buckets = vec![b0, b1];
        (r.optimizer_start_s, r.optimizer_end_s, r.step_end_s) = (waited + 0.001, waited + 0.002, waited + 0.002);
    }
    let shapes: [&[usize]; 2] = [&[512, 512], &[512, 512]];
    let low_rank = WireModel::LowRank {
        factors: vec![Some((512, 512)), Some((512, 512))],
        start_iter: 0,
    };
    under(p, "powersgd:1", Some(low_rank), &shapes)
}

/// The profile above with bucket 0's recorded start an earlier chain's (0 ms, before it was
/// handed over at 10 ms) and each rank's `reduce` issuing it at `issued` (seconds, per rank).
fn issued_after_an_earlier_chain(issued: [f64; 2]) -> StepProfile {
    let mut p = unlike_ranks_under_powersgd();
    for (r, issued) in p.ranks.iter_mut().zip(issued) {
        r.buckets[0].start_s = 0.0;
        r.buckets[0].issued_s = Some(issued);
    }
    p
}

#[test]
fn on_the_measured_link_a_low_rank_bucket_waits_once_for_the_last_rank_to_issue_it() {
    // The profile above, with bucket 0's recorded start an earlier chain's (0 ms, before it was
    // handed over at 10 ms) and rank 1's `reduce` issuing it 0.3 ms after rank 0 did. Rank 0's
    // recorded compute after its issue (12.5 − 10 − 2 = 0.5 ms) holds 0.3 ms of waiting for rank
    // 1: the replay starts the bucket at rank 1's issue, 10.3 ms, then 2 ms on the link fitted to
    // the recorded ones and 0.2 ms of compute, finishing at 12.5 ms as recorded (12.8 ms if the
    // wait were counted twice).
    let p = issued_after_an_earlier_chain([0.010, 0.0103]);
    let caps = ReplayConfig {
        order: BucketOrder::Reverse,
        link: LinkCost::Measured,
        ..cfg(1.0, 1.0)
    };
    let r = replay_with(&p, &caps, LaunchOverhead::default()).unwrap();
    close(r.buckets[0].launch_s, 0.0103, "bucket 0 issued by rank 1");
    close(r.buckets[0].finish_s, 0.0125, "bucket 0 with rank 0's compute less its wait");
}

#[test]
fn a_low_rank_bucket_waits_once_for_the_last_rank_to_issue_it_on_any_link() {
    // The profile above, with bucket 0's recorded start an earlier chain's (0 ms, before it was
    // handed over at 10 ms) and rank 0's `reduce` issuing it 0.3 ms after rank 1 did. Rank 1's
    // recorded compute after its issue (13.5 − 10 − 2 = 1.5 ms) holds 0.3 ms of waiting for rank
    // 0, rank 0's (12.5 − 10.3 − 2 = 0.2 ms) none: the replay starts the bucket at rank 0's
    // issue, 10.3 ms, then 4 ms + 4 KiB on the priced link and the slowest rank's compute less
    // its wait, 1.2 ms (1.5 ms if the wait were counted twice).
    let p = issued_after_an_earlier_chain([0.0103, 0.010]);
    let caps = ReplayConfig {
        order: BucketOrder::Reverse,
        ..cfg(1.0, 1.0)
    };
    let r = replay_with(&p, &caps, LaunchOverhead::default()).unwrap();
    let link_s = 0.004 + 4096.0 / (1u64 << 30) as f64;
    close(r.buckets[0].launch_s, 0.0103, "bucket 0 issued by rank 0");
    close(
        r.buckets[0].finish_s,
        0.0103 + link_s + 0.0012,
        "bucket 0 with rank 1's compute less its wait",
    );
}

#[test]
fn a_low_rank_bucket_is_charged_the_slowest_ranks_compute_recorded_for_that_bucket() {
    // Each collective of a bucket starts when the last rank has issued it, so a bucket takes
    // the slowest rank's compute for it: bucket 0 runs from 10 ms for 4 ms + 4 KiB on the link,
    // then 1.5 ms (rank 1's); bucket 1 then, with 1 ms (rank 0's). Rank 0's compute spread
    // per byte (0.75 ms a bucket) would predict 1 ms less.
    let p = unlike_ranks_under_powersgd();
    let caps = ReplayConfig {
        order: BucketOrder::Reverse,
        ..cfg(1.0, 1.0)
    };
    let r = replay_with(&p, &caps, LaunchOverhead::default()).unwrap();
    let link_s = 0.004 + 4096.0 / (1u64 << 30) as f64;
    close(
        r.buckets[0].finish_s,
        0.010 + link_s + 0.0015,
        "bucket 0 with rank 1's compute",
    );
    close(
        r.buckets[1].finish_s,
        0.010 + 2.0 * link_s + 0.0025,
        "bucket 1 with rank 0's compute",
    );
    close(r.policy_compute_s, 0.0025, "the policy's compute");
    close(
        r.predicted_step_s,
        0.010 + 2.0 * link_s + 0.0025 + 0.002,
        "predicted step",
    );
}

#[test]
fn on_the_measured_link_a_low_rank_bucket_is_charged_rank_0s_compute_recorded_for_it() {
    // Rank 0's recorded collectives hold its waits for the slower rank (2 ms each, fitted as
    // the link), so rank 0's compute for each bucket completes the chain: bucket 0 runs from
    // 10 ms for 2 ms, then 0.5 ms; bucket 1 for 2 ms, then 1 ms. The slowest rank's compute on
    // top of the fitted link would count the waits twice (1.5 ms + 1 ms).
    let p = unlike_ranks_under_powersgd();
    let caps = ReplayConfig {
        order: BucketOrder::Reverse,
        link: LinkCost::Measured,
        ..cfg(1.0, 1.0)
    };
    let r = replay_with(&p, &caps, LaunchOverhead::default()).unwrap();
    close(r.buckets[0].finish_s, 0.0125, "bucket 0 with rank 0's compute");
    close(r.buckets[1].finish_s, 0.0155, "bucket 1 with rank 0's compute");
    close(r.policy_compute_s, 0.0015, "the policy's compute");
}

#[test]
fn a_policys_compute_before_its_collective_delays_the_collective() {
    // Two 1 MiB gradients ready at 10 ms, one per bucket; the policy's `reduce` computed 1 ms
    // of each (a top-k selection) before issuing its collectives: bucket 0 is issued at 11 ms,
    // bucket 1 after it, at 12 ms. On the link each takes 2 ms + 1 MiB / 1 GiB/s.
    let mut p = profile(&[(MIB, 0.010), (MIB, 0.010)], 0.012);
    for r in &mut p.ranks {
        let mut b0 = recorded(vec![1], MIB, 0.010, 0.011, 0.014);
        b0.issued_s = Some(0.011);
        let mut b1 = recorded(vec![0], MIB, 0.010, 0.014, 0.017);
        (b1.launch_s, b1.issued_s) = (0.011, Some(0.012));
        r.buckets = vec![b0, b1];
        (r.optimizer_start_s, r.optimizer_end_s, r.step_end_s) = (0.017, 0.018, 0.018);
    }
    let caps = ReplayConfig {
        order: BucketOrder::Reverse,
        ..cfg(1.0, 1.0)
    };
    let r = replay_with(&p, &caps, LaunchOverhead::default()).unwrap();
    let link_s = 0.002 + 1.0 / 1024.0;
    close(r.buckets[0].start_s, 0.011, "bucket 0 once its selection is done");
    close(r.buckets[1].launch_s, 0.012, "bucket 1 once its own is");
    close(r.buckets[1].finish_s, 0.011 + 2.0 * link_s, "bucket 1 behind bucket 0");
    // at another cap, one bucket of both: its selection at the recorded rate per byte
    let one = replay_with(&p, &cfg(2.0, 2.0), LaunchOverhead::default()).unwrap();
    close(one.buckets[0].start_s, 0.012, "2 ms of selection for 2 MiB");
    // a chained policy's collectives counted from before the bucket was handed over: its
    // compute after its collectives is what is left once its `reduce` and they are done
    let mut b = recorded(vec![0], MIB, 0.010, 0.0, 0.014);
    (b.issued_s, b.link_s) = (Some(0.011), Some(0.0025));
    close(b.policy_compute_s(), 0.0005, "after the selection and the collectives");
}

#[test]
fn a_buckets_wait_for_the_compute_of_the_bucket_before_is_not_its_compute() {
    // Two 1 MiB buckets issued at 10 ms (a top-k's sparse gathers). Bucket 0 holds the link
    // 10.0..10.1 ms, then its continuation (summing the gathered entries) runs 10.1..11.0 ms;
    // bucket 1 holds the link 10.1..10.2 ms, but its continuation runs on the same thread, after
    // bucket 0's: 11.0..11.5 ms. Its own compute is 0.5 ms, not the 1.3 ms from its link's end:
    // 0.9 + 0.5 = 1.4 ms of compute for 2 MiB, 0.7 ms per bucket at the recorded caps.
    let mut p = profile(&[(MIB, 0.010), (MIB, 0.010)], 0.010);
    for r in &mut p.ranks {
        let mut b0 = recorded(vec![1], MIB, 0.010, 0.0100, 0.0110);
        b0.link_s = Some(0.0001);
        let mut b1 = recorded(vec![0], MIB, 0.010, 0.0101, 0.0115);
        b1.link_s = Some(0.0001);
        r.buckets = vec![b0, b1];
        (r.optimizer_start_s, r.optimizer_end_s, r.step_end_s) = (0.0115, 0.0125, 0.0125);
    }
    let (b0, b1) = (&p.ranks[0].buckets[0], &p.ranks[0].buckets[1]);
    close(b1.policy_compute_after(Some(b0)), 0.0005, "bucket 1's own compute");
    close(b0.policy_compute_after(None), 0.0009, "bucket 0's");
    let caps = ReplayConfig {
        order: BucketOrder::Reverse,
        ..cfg(1.0, 1.0)
    };
    let r = replay_with(&p, &caps, LaunchOverhead::default()).unwrap();
    close(r.policy_compute_s, 0.0014, "the policy's compute in the step");
    // on the 1 GiB/s ring each bucket holds the link 2 ms + 1 MiB / 1 GiB/s; bucket 1's compute
    // follows bucket 0's
    let link_s = 0.002 + 1.0 / 1024.0;
    close(r.buckets[0].finish_s, 0.010 + link_s + 0.0007, "bucket 0");
    close(r.buckets[1].finish_s, 0.010 + 2.0 * link_s + 0.0007, "bucket 1");
}

#[test]
fn what_reduce_spent_after_its_collective_started_does_not_delay_the_collective() {
    // One 1 MiB gradient ready at 10 ms on both ranks. Rank 1's `reduce` returned at 10.8 ms,
    // but its collective started on the link at 10.2 ms (rank 0 had issued it at 10.1 ms): rank
    // 1 had issued it by then, and the 0.6 ms after it were not compute before it. On the ring
    // the bucket starts when the last rank issued it, 10.2 ms, and takes 2 ms + 1 MiB / 1 GiB/s;
    // the recorded bucket held the comm stream 10.2..13.5 ms, its collective 3 ms of it: 0.3 ms
    // of compute after the collective, replayed after the ring's time.
    let mut p = profile(&[(MIB, 0.010)], 0.0102);
    for (r, issued) in p.ranks.iter_mut().zip([0.0101, 0.0108]) {
        let mut b = recorded(vec![0], MIB, 0.010, 0.0102, 0.0135);
        (b.issued_s, b.link_s) = (Some(issued), Some(0.003));
        r.buckets = vec![b];
        (r.optimizer_start_s, r.optimizer_end_s, r.step_end_s) = (0.0135, 0.0145, 0.0145);
    }
    close(
        p.ranks[1].buckets[0].reduce_s(),
        0.0002,
        "rank 1's compute before its collective",
    );
    close(
        p.ranks[1].buckets[0].policy_compute_s(),
        0.0003,
        "its compute after the collective",
    );
    let r = replay_with(&p, &cfg(25.0, 25.0), LaunchOverhead::default()).unwrap();
    let link_s = 0.002 + 1.0 / 1024.0;
    close(
        r.buckets[0].start_s,
        0.0102,
        "the bucket starts when rank 1 had issued it",
    );
    close(
        r.buckets[0].finish_s,
        0.0102 + link_s + 0.0003,
        "its collective, then the compute after it",
    );
}

#[test]
fn a_collective_that_waited_for_the_previous_buckets_continuation_does_not_measure_the_link() {
    // Buckets of 1 MiB and 256 KiB recorded one after the other on the 1 ms, 1 GiB/s link fix
    // it; a third bucket, issued while the second's continuation still held the comm stream,
    // could only finish after it: its recorded collective time (5 ms) is not the link's.
    let mut p = profile(&[(MIB, 0.010), (MIB / 4, 0.020), (MIB / 4, 0.020)], 0.020);
    let on_link = |bytes: usize| 0.002 + bytes as f64 / (1u64 << 30) as f64;
    for r in &mut p.ranks {
        let mut b0 = recorded(vec![0], MIB, 0.010, 0.010, 0.010 + on_link(MIB));
        b0.link_s = Some(on_link(MIB));
        let mut b1 = recorded(vec![1], MIB / 4, 0.020, 0.020, 0.030);
        b1.link_s = Some(on_link(MIB / 4));
        let mut b2 = recorded(vec![2], MIB / 4, 0.025, 0.025, 0.0305);
        b2.link_s = Some(0.005);
        r.buckets = vec![b0, b1, b2];
        (r.optimizer_start_s, r.optimizer_end_s, r.step_end_s) = (0.031, 0.032, 0.032);
    }
    let link = brigade_ddp::overlap::measured_link(&[&p]).unwrap().unwrap();
    close_to(link.latency.as_secs_f64(), 0.001, 1e-6, "latency");
    close_to(link.bandwidth_bytes_per_s, (1u64 << 30) as f64, 1e-6, "bandwidth");
}

#[test]
fn a_collective_that_started_before_the_previous_ones_recorded_finish_measures_the_link() {
    // Buckets of 1 MiB and 256 KiB on the 1 ms, 1 GiB/s link; the first computed nothing after
    // its collective, but its recorded finish came 0.1 ms after the second had started on the
    // link (its landing, as ZeRO lands a bucket into the shard): the second did not wait for
    // it, and both measure the link.
    let mut p = profile(&[(MIB, 0.010), (MIB / 4, 0.010)], 0.010);
    let on_link = |bytes: usize| 0.002 + bytes as f64 / (1u64 << 30) as f64;
    for r in &mut p.ranks {
        let mut b0 = recorded(vec![0], MIB, 0.010, 0.010, 0.010 + on_link(MIB) + 0.0001);
        b0.link_s = Some(on_link(MIB) + 0.0001);
        let start = 0.010 + on_link(MIB);
        let mut b1 = recorded(vec![1], MIB / 4, 0.010, start, start + on_link(MIB / 4));
        b1.link_s = Some(on_link(MIB / 4));
        r.buckets = vec![b0, b1];
        (r.optimizer_start_s, r.optimizer_end_s, r.step_end_s) = (0.020, 0.021, 0.021);
    }
    let link = brigade_ddp::overlap::measured_link(&[&p]).unwrap().unwrap();
    // least squares over both: within the first one's 0.1 ms of landing
    close_to(link.latency.as_secs_f64(), 0.001, 0.3, "latency");
    close_to(link.bandwidth_bytes_per_s, (1u64 << 30) as f64, 0.5, "bandwidth");
}

#[test]
fn a_bucket_start_from_before_it_was_handed_over_does_not_set_the_clocks() {
    // Rank 1's clock runs 1 ms behind rank 0's: bucket 1 started on the link at 12 ms on rank
    // 0's clock, 11 ms on rank 1's. Bucket 0's recorded starts (0 ms, before it was handed
    // over: a chained policy's wait for the previous step's last bucket) say nothing of it.
    let mut p = profile(&[(MIB, 0.010), (MIB, 0.010)], 0.010);
    for (r, rank) in p.ranks.iter_mut().enumerate() {
        let shift = if r == 1 { -0.001 } else { 0.0 };
        rank.buckets = vec![
            recorded(vec![1], MIB, 0.010, 0.0, 0.011 + shift),
            recorded(vec![0], MIB, 0.010, 0.012 + shift, 0.014 + shift),
        ];
    }
    close(p.clock_offsets()[1], -0.001, "rank 1's clock");
}

#[test]
fn a_ranks_wait_at_the_agreement_for_the_last_rank_is_charged_once() {
    use brigade_ddp::overlap::ControlProfile;
    use brigade_ddp::policy::WireOp;
    // Both 1 MiB gradients ready at 10 ms on both ranks. Rank 0 left its bucket at 12 ms, rank
    // 1 at 11 ms (its own compute after the collective ended sooner); both met at the loss
    // agreement, which finished at 12.5 ms on both, and stepped 13..14 ms: rank 1's gap after
    // its bucket holds 1 ms of waiting for rank 0. Replayed, the bucket ends at 13.953125 ms
    // on both and both wait for it there: the step is the one with rank 1 leaving at 12 ms.
    let step = |rank1_left: f64| {
        let mut p = profile(&[(MIB, 0.010), (MIB, 0.010)], 0.010);
        for (i, r) in p.ranks.iter_mut().enumerate() {
            let left = if i == 1 { rank1_left } else { 0.012 };
            r.buckets = vec![recorded(vec![1, 0], 2 * MIB, 0.010, 0.010, left)];
            r.control = vec![ControlProfile {
                op: WireOp::AllReduce,
                bytes: 12,
                link_s: 0.0,
                finish_s: Some(0.0125),
            }];
            (r.optimizer_start_s, r.optimizer_end_s, r.step_end_s) = (0.013, 0.014, 0.014);
        }
        replay(&p, &cfg(100.0, 100.0)).unwrap().predicted_step_s
    };
    close(step(0.011), step(0.012), "the step with rank 1's wait in its gap");
}

#[test]
fn the_ranks_clocks_are_set_by_the_agreement_every_rank_leaves_together() {
    use brigade_ddp::overlap::ControlProfile;
    use brigade_ddp::policy::WireOp;
    // Rank 1's clock runs 1 ms behind rank 0's. A chained policy's buckets (PowerSGD's P and Q
    // all-reduces, a bucket at a time) start on each rank when its own previous chain ended:
    // bucket 1 at 12 ms on rank 0, at 12.5 ms (rank 0's clock) on rank 1, whose orthogonalising
    // took 0.5 ms longer. The loss agreement, a blocking all-reduce, finished at 15 ms on rank
    // 0's clock on both: 14 ms on rank 1's. The bucket starts alone would say 0.5 ms.
    let mut p = profile(&[(MIB, 0.010), (MIB, 0.010)], 0.010);
    for (r, rank) in p.ranks.iter_mut().enumerate() {
        let (shift, late) = if r == 1 { (-0.001, 0.0005) } else { (0.0, 0.0) };
        rank.buckets = vec![
            recorded(vec![1], MIB, 0.010, 0.0, 0.012 + late + shift),
            recorded(vec![0], MIB, 0.010, 0.012 + late + shift, 0.014 + shift),
        ];
        rank.control = vec![ControlProfile {
            op: WireOp::AllReduce,
            bytes: 12,
            link_s: 0.0,
            finish_s: Some(0.015 + shift),
        }];
    }
    close(p.clock_offsets()[1], -0.001, "rank 1's clock");
    // a profile written before the agreement's finish was recorded reads, and takes the clocks
    // from the bucket starts
    let mut json = serde_json::to_value(&p).unwrap();
    for rank in json["ranks"].as_array_mut().unwrap() {
        rank["control"][0].as_object_mut().unwrap().remove("finish_s").unwrap();
    }
    let old: StepProfile = serde_json::from_value(json).unwrap();
    assert!(old.ranks.iter().all(|r| r.control[0].finish_s.is_none()));
    close(old.clock_offsets()[1], -0.0005, "rank 1's clock from the buckets");
    // one rank without it: every rank's clock from the buckets
    p.ranks[1].control[0].finish_s = None;
    close(p.clock_offsets()[1], -0.0005, "rank 1's clock from the buckets");
}
