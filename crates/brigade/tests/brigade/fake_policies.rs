//! Every built-in reducer policy and both user-policy examples (int8 `own_hook`, `local_sgd`,
//! compiled here from `examples/`, not copied) training the small GPT on the counting fake
//! device with two thread ranks, host-staged: the same losses as on the CPU, bit for bit (the
//! fake device runs the CPU's kernels and the collectives the same sums), and per step nothing
//! copied between host and device but each rank's tokens, its loss, and what each collective
//! stages through the host, counted exactly from the model's parameter shapes; no host wait.
//! A host read added to a policy (a scale read back, a `to_vec` of a gradient) changes these
//! counts and fails the test.
//!
//! The counts of one step are the difference between a 3-step and a 1-step run, halved
//! ([`crate::fake_device::step_counts`]): setup and the first step's one-off work cancel.
//!
//! Both examples also run on the device comm stream (`ddp::group::DeviceGroup`, the stream
//! NCCL drives, its collectives staged on the comm stream here): the CPU's losses, and nothing
//! read back on the compute stream in a step but the loss (the int8 example read its scale back
//! with `item()` and sent it from the host before: that fails there).

use std::sync::Arc;

use brigade::config::{OptimizerConfig, TrainConfig};
use brigade::ddp::ReducerPolicy;
use brigade::launch::LaunchConfig;
use brigade::models::{Dataset, Gpt, Model};
use brigade::placement::DevicePlacement;
use brigade::policies::PolicySpec;
use brigade::policy::MakePolicy;
use brigade::tensor::fake::{self, FakeCounts};
use brigade::{fit, Error};

use crate::fake_device::{small_gpt, step_counts};

#[allow(dead_code)]
#[path = "../../examples/own_hook.rs"]
pub(crate) mod own_hook;

#[allow(dead_code)]
#[path = "../../examples/local_sgd.rs"]
pub(crate) mod local_sgd;

const WORLD: u64 = 2;
/// Bytes of one rank's tokens a step ([2, 17] bytes) and of its loss (one f64).
const TOKENS: u64 = 2 * 17;
const LOSS: u64 = 8;

/// Trains the small GPT under `hook` for `steps` steps, two thread ranks, on fake device
/// `ordinal` (or the CPU); the device's counts and rank 0's losses.
fn run(steps: usize, ordinal: Option<usize>, hook: Arc<dyn MakePolicy>) -> (FakeCounts, Vec<f64>) {
    let mut cfg = TrainConfig::new(
        steps,
        2,
        OptimizerConfig::Sgd {
            lr: 0.1,
            momentum: 0.0,
            weight_decay: 0.0,
        },
    );
    cfg.distributed.get_or_insert_default().policy = hook;
    if let Some(o) = ordinal {
        cfg.runtime.device = DevicePlacement::Fake(o);
        fake::reset(o);
    }
    let report = fit(
        &LaunchConfig::threads(WORLD as usize),
        &cfg,
        |_world| Dataset::builtin_text(16, 0).map_err(Error::from),
        |_ctx| Ok(Box::new(Gpt::new(small_gpt(), 0)?)),
    )
    .unwrap();
    (ordinal.map(fake::counts).unwrap_or_default(), report.outcome.losses())
}

/// One step's counts on fake device `ordinal` under `hook`, after checking that its 3 steps'
/// losses are the CPU's bit for bit.
fn per_step(ordinal: usize, hook: impl MakePolicy + 'static) -> FakeCounts {
    let hook: Arc<dyn MakePolicy> = Arc::new(hook);
    let (one, _) = run(1, Some(ordinal), hook.clone());
    let (three, losses) = run(3, Some(ordinal), hook.clone());
    let (_, cpu) = run(3, None, hook);
    assert_eq!(losses, cpu, "the fake device's losses are not the CPU's");
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    step_counts(one, three)
}

/// The small GPT's parameter shapes, in registration order.
fn shapes() -> Vec<Vec<usize>> {
    Gpt::new(small_gpt(), 0)
        .unwrap()
        .params()
        .params()
        .iter()
        .map(|p| p.value().shape().to_vec())
        .collect()
}

fn numel() -> u64 {
    shapes().iter().map(|s| s.iter().product::<usize>() as u64).sum()
}

/// Asserts one step's copies: per rank, `to_host` and `to_device` are the byte sizes of each
/// copy besides the loss and the tokens; no host wait, no deferred free.
fn assert_copies(c: FakeCounts, to_host: &[u64], to_device: &[u64]) {
    let w = WORLD;
    assert_eq!(c.to_host, w * (1 + to_host.len() as u64), "{c:?}");
    assert_eq!(c.to_host_bytes, w * (LOSS + to_host.iter().sum::<u64>()), "{c:?}");
    assert_eq!(c.to_device, w * (1 + to_device.len() as u64), "{c:?}");
    assert_eq!(c.to_device_bytes, w * (TOKENS + to_device.iter().sum::<u64>()), "{c:?}");
    assert_eq!((c.host_waits, c.deferred_frees), (0, 0), "{c:?}");
}

// The small GPT's gradients (0.2 MB of f32) fill one bucket under DDP's caps, before and
// after the rebuild: one bucket per rank and step.

#[test]
fn fp16_and_bf16_stage_their_half_bucket_and_fp16_reads_its_overflow_check() {
    let p = numel();
    // the 16-bit bucket out and back; fp16 also reads the f32 sum of squares of the result
    // (its overflow check)
    assert_copies(per_step(211, PolicySpec::Fp16), &[2 * p, 4], &[2 * p]);
    assert_copies(per_step(212, PolicySpec::Bf16), &[2 * p], &[2 * p]);
}

#[test]
fn powersgd_stages_its_uncompressed_tensors_and_its_two_factors() {
    // rank 1 from the first step (start 0): the 1-D and too-small tensors with P (n x 1 per
    // matrix) in one all-reduce, Q (m x 1) in another; Q is warm-started from step 0, so
    // nothing is drawn (uploaded) after it
    let (mut plain, mut p_len, mut q_len) = (0u64, 0u64, 0u64);
    for s in shapes() {
        let len: usize = s.iter().product();
        if s.len() >= 2 {
            let (n, m) = (s[0], len / s[0]);
            if ((n + m) as f64) * 2.0 < (n * m) as f64 {
                p_len += n as u64;
                q_len += m as u64;
                continue;
            }
        }
        plain += len as u64;
    }
    assert!(plain > 0 && p_len > 0, "the GPT has both kinds of tensors");
    let c = per_step(213, PolicySpec::PowerSgd { rank: 1, start_iter: 0 });
    let staged = [4 * (plain + p_len), 4 * q_len];
    assert_copies(c, &staged, &staged);
}

#[test]
fn zero_1_and_2_stage_the_reduce_scatter_and_the_parameter_all_gathers() {
    let padded = numel().div_ceil(WORLD) * WORLD;
    let per = padded / WORLD;
    // ZeRO-1: the bucket out, this rank's shard back; its updated parameters gathered into the
    // idle bucket (the whole bucket staged out, every rank's shard back in)
    assert_copies(
        per_step(214, PolicySpec::Zero1),
        &[4 * padded, 4 * padded],
        &[4 * per, 4 * padded],
    );
    // ZeRO-2: the same reduce-scatter; the parameters gathered in chunks of a sixth of a shard
    // at world 2 (each at most a third of a shard's worth of gathered parameters)
    let chunk = (per / (3 * WORLD)).max(1);
    let mut out = vec![4 * padded];
    let mut back = vec![4 * per];
    for start in (0..per).step_by(chunk as usize) {
        let len = chunk.min(per - start);
        out.push(4 * len);
        back.push(4 * WORLD * len);
    }
    assert_copies(per_step(215, PolicySpec::Zero2), &out, &back);
}

#[test]
fn the_int8_example_host_staged_sends_its_payload_and_its_device_scale() {
    let p = numel();
    let hook = |_rank: usize| own_hook::Int8::default();
    // the int8 payload and its one f32 scale out; every rank's payloads and scales back
    assert_copies(per_step(216, hook), &[p, 4], &[WORLD * p, WORLD * 4]);
}

#[test]
fn the_local_sgd_example_host_staged_averages_the_models_after_each_step() {
    // K = 1, H = 1: after step 0 no gradient crosses the ranks, and after every step each
    // parameter is averaged in place (its own storage staged out and back)
    let hook = |_rank: usize| local_sgd::LocalSgd::new(1, 1);
    let each: Vec<u64> = shapes()
        .iter()
        .map(|s| 4 * s.iter().product::<usize>() as u64)
        .collect();
    assert_copies(per_step(217, hook), &each, &each);
}

/// Trains the small GPT under `policy` for 3 steps through DDP directly, two thread ranks: on
/// fake devices `ordinal + rank` over the device comm stream (the stream NCCL drives on a GPU;
/// here its collectives are staged through the host on the comm stream), or on the CPU over the
/// host stream. Each rank's losses, and the fake device's log of the last step.
fn on_the_device_stream(
    policy: impl Fn() -> Box<dyn ReducerPolicy> + Sync,
    ordinal: Option<usize>,
) -> Vec<(Vec<f64>, Vec<fake::FakeOp>, u64)> {
    use brigade::autograd::{Optimizer, Sgd};
    use brigade::comm::run_on_threads;
    use brigade::ddp::group::{DeviceGroup, HostGroup};
    use brigade::ddp::Group;
    use brigade::ddp::{DdpConfig, DistributedDataParallel};
    use brigade::models::Batch;
    use brigade::tensor::Device;
    let data = Dataset::builtin_text(16, 0).unwrap();
    run_on_threads(WORLD as usize, |comm| {
        brigade::tensor::set_compute_threads(1);
        let rank = comm.rank();
        let comm = Arc::new(comm);
        let device = ordinal.map_or(Device::Cpu, |o| Device::Fake(o + rank));
        let model = Gpt::new(small_gpt(), 0).unwrap();
        for p in model.params().params() {
            p.set_value(p.value().to_device(device).unwrap()).unwrap();
        }
        let (stream, comm_stream): (Group, u64) = match ordinal {
            Some(_) => {
                let s = DeviceGroup::host_staged(device, comm.clone()).unwrap();
                let id = s.comm_stream().raw_handle();
                (Arc::new(s), id)
            }
            None => (Arc::new(HostGroup::new(comm.clone())), 0),
        };
        let ddp =
            DistributedDataParallel::with_group(model.params(), comm, stream, DdpConfig::default(), policy()).unwrap();
        let sgd = |p| Box::new(Sgd::new(p, 0.1, 0.0, 0.0)) as Box<dyn Optimizer>;
        let mut opt = ddp.optimizer(sgd(model.params().params().to_vec()), &sgd).unwrap();
        let (mut losses, mut log) = (vec![], vec![]);
        for step in 0..3 {
            let batch = data.batch((step * WORLD as usize + rank) * 2, 2).unwrap();
            let on = batch
                .into_tensors()
                .into_iter()
                .map(|(n, t)| (n, t.to_device(device).unwrap()));
            let batch = Batch::new(on.collect()).unwrap();
            if let (2, Some(o)) = (step, ordinal) {
                fake::start_log(o + rank);
            }
            model.params().zero_grad().unwrap();
            let loss = model.loss(&batch).unwrap();
            loss.backward().unwrap();
            opt.step().unwrap();
            losses.push(loss.value().item().unwrap());
            if let (2, Some(o)) = (step, ordinal) {
                log = fake::take_log(o + rank);
            }
        }
        (losses, log, comm_stream)
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

/// The user's policy on the device comm stream: the CPU's losses bit for bit, and in a step the
/// compute stream copies nothing back but the loss (every other copy is a collective's staging
/// on the comm stream, which NCCL does in device memory) and the host never waits.
fn assert_runs_on_the_device_stream(policy: impl Fn() -> Box<dyn ReducerPolicy> + Sync, ordinal: usize) {
    let device = on_the_device_stream(&policy, Some(ordinal));
    let cpu = on_the_device_stream(&policy, None);
    for ((losses, log, comm), (want, _, _)) in device.iter().zip(&cpu) {
        assert_eq!(losses, want, "the device stream's losses are not the CPU's");
        let back: Vec<_> = log
            .iter()
            .filter(|op| matches!(op.what, fake::FakeWhat::ToHost(_)) && op.stream != *comm)
            .collect();
        assert_eq!(back.len(), 1, "copies back on the compute stream: {back:?}");
        // the loss, one f32 (fit reads it as an f64)
        assert_eq!(back[0].what, fake::FakeWhat::ToHost(4));
        assert!(!log.iter().any(|op| op.what == fake::FakeWhat::HostWait), "{log:?}");
    }
}

#[test]
fn the_int8_and_local_sgd_examples_run_unchanged_on_the_device_comm_stream() {
    assert_runs_on_the_device_stream(|| Box::new(own_hook::Int8::default()), 218);
    assert_runs_on_the_device_stream(|| Box::new(local_sgd::LocalSgd::new(1, 1)), 220);
}

/// The small GPT's ZeRO-3 units in forward order, each with its flat length padded to the
/// world size.
fn units() -> Vec<(String, u64)> {
    let model = Gpt::new(small_gpt(), 0).unwrap();
    let store = model.params();
    let mut units: Vec<(String, u64)> = vec![];
    for (i, p) in store.params().iter().enumerate() {
        let unit = store.unit(i).expect("every GPT parameter has a unit").to_string();
        let n = p.value().numel() as u64;
        match units.iter_mut().find(|(u, _)| *u == unit) {
            Some((_, len)) => *len += n,
            None => units.push((unit, n)),
        }
    }
    units.into_iter().map(|(u, n)| (u, n.div_ceil(WORLD) * WORLD)).collect()
}

/// Each ZeRO-3 gather of a step, in order, as the length of the unit it gathers: in forward
/// every unit as its scope is entered (the loss in the head's), in backward every unit again,
/// the last first.
fn zero_3_gathers() -> Vec<u64> {
    let units = units();
    assert_eq!(units.len(), 4, "embed, two blocks, head: {units:?}");
    let len: Vec<u64> = units.iter().map(|(_, n)| *n).collect();
    vec![len[0], len[1], len[2], len[3], len[3], len[2], len[1], len[0]]
}

#[test]
fn zero_3_stages_each_units_gathers_and_reduce_scatter_and_reads_nothing_back() {
    // through the host group (the thread backend): each gather stages its output buffer out
    // (this rank's shard copied to its head) and every rank's shards back; each unit's bucket
    // is reduce-scattered once (the whole bucket out, the rank's shard back); no host wait,
    // nothing freed behind a collective still running
    let (mut out, mut back) = (vec![], vec![]);
    for len in zero_3_gathers() {
        out.push(4 * len);
        back.push(4 * len);
    }
    for (_, len) in units().iter().rev() {
        out.push(4 * len);
        back.push(4 * len / WORLD);
    }
    assert_copies(per_step(222, PolicySpec::Zero3), &out, &back);
}

#[test]
fn zero_3_on_the_device_comm_stream_computes_while_its_prefetched_gathers_run() {
    use brigade::policies::Zero3;
    use fake::FakeWhat;
    let policy = || Box::new(Zero3::new()) as Box<dyn ReducerPolicy>;
    let device = on_the_device_stream(policy, Some(224));
    let cpu = on_the_device_stream(policy, None);
    for ((losses, log, comm), (want, _, _)) in device.iter().zip(&cpu) {
        assert_eq!(losses, want, "the device stream's losses are not the CPU's");
        let back: Vec<_> = log
            .iter()
            .filter(|op| matches!(op.what, FakeWhat::ToHost(_)) && op.stream != *comm)
            .collect();
        assert_eq!(back.len(), 1, "copies back on the compute stream: {back:?}");
        assert!(!log.iter().any(|op| op.what == FakeWhat::HostWait), "{log:?}");
        // each collective on the comm stream ends with its done event; a gather brings back
        // more than it sends (every rank's shard), a reduce-scatter less
        let (mut sent, mut brought) = (0, 0);
        let mut gathers = vec![];
        for (at, op) in log.iter().enumerate().filter(|(_, op)| op.stream == *comm) {
            match op.what {
                FakeWhat::ToHost(b) => sent = b,
                FakeWhat::ToDevice(b) => brought = b,
                FakeWhat::Record(event) if brought > sent => {
                    gathers.push((at, event, brought / 4));
                    (sent, brought) = (0, 0);
                }
                FakeWhat::Record(_) => (sent, brought) = (0, 0),
                _ => {}
            }
        }
        let lengths: Vec<u64> = gathers.iter().map(|g| g.2).collect();
        assert_eq!(lengths, zero_3_gathers(), "{log:?}");
        // the compute stream waits on each gather's done event only when its unit is needed:
        // a prefetched gather (every one but the first of each pass) runs while the compute
        // stream runs the unit before it
        let mut overlapped = 0;
        for &(at, event, _) in &gathers {
            let wait = log
                .iter()
                .position(|op| op.stream != *comm && matches!(op.what, FakeWhat::Wait { event: e, .. } if e == event))
                .unwrap_or_else(|| panic!("the compute stream never waits on gather event {event}: {log:?}"));
            assert!(wait > at, "{log:?}");
            let computed = log[at..wait]
                .iter()
                .any(|op| op.stream != *comm && matches!(op.what, FakeWhat::Kernel(_)));
            overlapped += computed as usize;
        }
        assert_eq!(overlapped, gathers.len() - 2, "{log:?}");
    }
}
