//! Policies a user writes against the public contract alone (`brigade_ddp::policy`): int8
//! quantization with error feedback (a per-bucket scale sent beside the payload, reduced by the
//! kit's rule: gather, dequantize each rank's piece, sum in f32) and local SGD (all-reduce for
//! the first K steps, then each rank trains alone and the models are averaged every H steps).
//! Plus what the registry and the specs do with such a policy.

use crate::common::{max_diff, spec, train, RankRun, Setup};

use std::collections::HashMap;

use brigade_comm::ReduceOp;
use brigade_ddp::policy::{Group, PolicyBucket, Reduction, StepContext};
use brigade_ddp::{DdpError, ReducerPolicy};
use brigade_policies::{PolicyError, PolicySpec, Registry};
use brigade_tensor::{DType, Tensor};

const WIDTHS: [usize; 4] = [16, 64, 64, 4];

const SETUP: Setup = Setup {
    widths: &WIDTHS,
    steps: 60,
    accum: 1,
    micro: 16,
    bucket_cap_mb: 0.01,
    first_bucket_cap_mb: 0.004,
};

/// Int8 with error feedback: each rank adds what it could not send last time, quantizes with one
/// scale per bucket (its largest magnitude over 127), sends the int8 payload with the scale as a
/// side buffer, keeps the rounding error; the ranks' pieces are dequantized with their own
/// scales and summed in f32. Error feedback is kept per parameter, so it survives DDP's rebuild.
struct Int8 {
    error: HashMap<usize, Tensor>,
}

impl ReducerPolicy for Int8 {
    fn name(&self) -> String {
        "int8-own".into()
    }

    fn reduce(&mut self, bucket: PolicyBucket, comm: &Group) -> brigade_ddp::Result<Reduction> {
        let g = bucket.tensor.copy()?;
        for p in &bucket.params {
            if let Some(e) = self.error.get(&p.index) {
                g.narrow(0, p.offset, p.len())?.add_assign(e)?;
            }
        }
        let largest = g.sqr()?.max_dim(0, false)?.sqrt()?.item()?;
        let scale = if largest > 0.0 { largest / 127.0 } else { 1.0 };
        let q = g.mul_scalar(1.0 / scale)?.to_dtype(DType::I8)?;
        let sent = q.to_dtype(DType::F32)?.mul_scalar(scale)?;
        let error = g.sub(&sent)?;
        for p in &bucket.params {
            self.error.insert(p.index, error.narrow(0, p.offset, p.len())?.copy()?);
        }
        let world = comm.world_size() as f64;
        let scales = Tensor::from_vec(vec![scale as f32], &[1])?;
        let gathered = comm.all_gather_with_side(&q, &scales, &bucket.tag());
        Ok(Reduction::Full(gathered.then(move |(q, s)| {
            // [world, n] payloads times [world, 1] scales, summed over the ranks in f32
            Ok(q.to_dtype(DType::F32)?
                .mul(&s)?
                .sum(&[0], false)?
                .mul_scalar(1.0 / world)?)
        })))
    }
}

/// Local SGD: plain averaging all-reduce for the first `k` steps; after that no gradient
/// crosses the ranks, and every `h` steps the models are averaged.
struct LocalSgd {
    k: u64,
    h: u64,
    steps: u64,
}

impl ReducerPolicy for LocalSgd {
    fn name(&self) -> String {
        format!("local-sgd:{}@{}", self.h, self.k)
    }

    fn reduce(&mut self, bucket: PolicyBucket, comm: &Group) -> brigade_ddp::Result<Reduction> {
        if self.steps < self.k {
            return Ok(Reduction::Full(comm.all_reduce(
                &bucket.tensor,
                ReduceOp::Avg,
                &bucket.tag(),
            )));
        }
        // the rank's own gradients, untouched
        Ok(Reduction::Full(comm.ready(bucket.tensor)))
    }

    #[allow(clippy::manual_is_multiple_of)] // `is_multiple_of` is newer than the workspace MSRV
    fn after_step(&mut self, step: &StepContext<'_>, comm: &Group) -> brigade_ddp::Result<()> {
        self.steps += 1;
        if self.steps > self.k && (self.steps - self.k) % self.h == 0 {
            for (i, p) in step.params.iter().enumerate() {
                comm.all_reduce(&p.value(), ReduceOp::Avg, &format!("local-sgd.param{i}"))
                    .wait()?;
            }
        }
        Ok(())
    }

    fn keeps_state(&self) -> brigade_ddp::KeepsState {
        brigade_ddp::KeepsState::InStateDict
    }

    fn state_dict(&self) -> brigade_ddp::Result<Vec<(String, Tensor)>> {
        Ok(vec![("steps".into(), Tensor::from_vec(vec![self.steps as i64], &[1])?)])
    }

    fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> brigade_ddp::Result<()> {
        let steps = state.iter().find(|(k, _)| k == "steps").map(|(_, t)| t);
        self.steps = steps
            .ok_or_else(|| DdpError::PolicyState("local SGD: no 'steps'".into()))?
            .item()? as u64;
        Ok(())
    }
}

fn falls(run: &RankRun) -> bool {
    let n = run.losses.len();
    let head: f64 = run.losses[..5].iter().sum::<f64>() / 5.0;
    let tail: f64 = run.losses[n - 5..].iter().sum::<f64>() / 5.0;
    tail < 0.8 * head
}

#[test]
fn int8_with_error_feedback_trains_on_a_quarter_of_the_wire_bytes_plus_its_scales() {
    let plain = train(SETUP, 2, "sgd", spec("allreduce"));
    let int8 = train(SETUP, 2, "sgd", |_| {
        Box::new(Int8 { error: HashMap::new() }) as Box<dyn ReducerPolicy>
    });
    assert!(falls(&int8[0]), "int8 did not train: {:?}", int8[0].losses);
    // ranks agree: every rank dequantized the same pieces
    assert_eq!(max_diff(&int8[0].params, &int8[1].params), 0.0);
    // and it stays close to plain DDP
    let gap = (int8[0].losses[SETUP.steps - 1] - plain[0].losses[SETUP.steps - 1]).abs();
    assert!(gap < 0.05, "int8 ends {gap} from all-reduce");
    // The wire, as the meter counts it: at world 2 an f32 all-reduce sends 4 bytes per gradient
    // element per step, the int8 all-gather 1 byte per element plus a 4-byte scale per bucket:
    // a quarter of the bytes, and the scales. Both runs broadcast rank 0's ready order once.
    let psi: f64 = WIDTHS.windows(2).map(|w| (w[0] * w[1] + w[1]) as f64).sum();
    let params = 2.0 * (WIDTHS.len() - 1) as f64;
    let rebuild = 4.0 * params / 2.0;
    let steps = SETUP.steps as f64;
    assert_eq!(plain[0].wire_bytes, steps * 4.0 * psi + rebuild);
    let buckets_per_step = (int8[0].wire_bytes - rebuild - steps * psi) / (4.0 * steps);
    assert!(
        buckets_per_step.fract() == 0.0 && (1.0..=params).contains(&buckets_per_step),
        "int8 sent {} bytes: not psi + 4 per bucket a step",
        int8[0].wire_bytes
    );
    let ratio = int8[0].wire_bytes / plain[0].wire_bytes;
    assert!(ratio < 0.26, "int8 sent {ratio} of all-reduce's wire bytes");
}

#[test]
fn local_sgd_trains_and_the_ranks_meet_at_every_averaging() {
    let (k, h) = (4, 5);
    let steps_at = |n: usize| Setup { steps: n, ..SETUP };
    let local = |n: usize| {
        train(steps_at(n), 2, "sgd", |_| {
            Box::new(LocalSgd { k, h, steps: 0 }) as Box<dyn ReducerPolicy>
        })
    };
    // after K + H steps the models were just averaged: every rank holds the same parameters
    let met = local(4 + 5);
    assert_eq!(max_diff(&met[0].params, &met[1].params), 0.0);
    // one step later each rank has taken a step of its own
    let apart = local(4 + 5 + 1);
    assert!(
        max_diff(&apart[0].params, &apart[1].params) > 0.0,
        "the ranks did not train apart"
    );
    // over the whole run the loss falls, with a fraction of the all-reduce's bytes
    let run = local(SETUP.steps);
    assert!(falls(&run[0]), "local SGD did not train: {:?}", run[0].losses);
    let plain = train(SETUP, 2, "sgd", spec("allreduce"));
    assert!(run[0].wire_bytes < 0.5 * plain[0].wire_bytes);
    // and until step K it is plain all-reduce, bit for bit
    assert_eq!(run[0].losses[..=k as usize], plain[0].losses[..=k as usize]);
}

#[test]
fn policy_specs_read_back_what_they_write_and_say_what_they_take() {
    for s in [
        "allreduce",
        "fp16",
        "bf16",
        "powersgd:4",
        "powersgd:4@2",
        "zero1",
        "zero2",
        "int8",
        "topk:0.05",
    ] {
        assert_eq!(s.parse::<PolicySpec>().unwrap().to_string(), s);
    }
    // the default start iteration is not written
    assert_eq!("powersgd:4@10".parse::<PolicySpec>().unwrap().to_string(), "powersgd:4");
    for (bad, says) in [
        ("powersgd", "needs its rank"),
        ("powersgd:0", ">= 1"),
        ("powersgd:two", "whole number"),
        ("powersgd:2@x", "start iteration"),
        ("fp16:3", "takes no argument"),
        ("9lives", "not a policy name"),
    ] {
        let e = bad.parse::<PolicySpec>().unwrap_err().to_string();
        assert!(e.contains(&format!("'{bad}'")) && e.contains(says), "{bad}: {e}");
    }
    assert_eq!("zero2".parse::<PolicySpec>().unwrap().zero_stage().level(), 2);
}

#[test]
fn a_registered_user_policy_is_built_by_name_like_the_built_in_ones() {
    let mut registry = Registry::new();
    registry
        .register("int8-own", |_| {
            Ok(Box::new(Int8 { error: HashMap::new() }) as Box<dyn ReducerPolicy>)
        })
        .unwrap();
    registry
        .register("local-sgd", |arg| {
            let h: u64 = arg.unwrap_or("8").parse().map_err(|_| PolicyError::Config {
                policy: "local-sgd".into(),
                reason: "H must be a whole number".into(),
            })?;
            Ok(Box::new(LocalSgd { k: 2, h, steps: 0 }) as Box<dyn ReducerPolicy>)
        })
        .unwrap();
    let p = "local-sgd:3".parse::<PolicySpec>().unwrap().build(&registry).unwrap();
    assert_eq!(p.name(), "local-sgd:3@2");
    assert_eq!(
        "int8-own"
            .parse::<PolicySpec>()
            .unwrap()
            .build(&registry)
            .unwrap()
            .name(),
        "int8-own"
    );
    let e = "local-sgd:x"
        .parse::<PolicySpec>()
        .unwrap()
        .build(&registry)
        .err()
        .unwrap();
    assert!(e.to_string().contains("whole number"), "{e}");
    let e = "signum"
        .parse::<PolicySpec>()
        .unwrap()
        .build(&registry)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("unknown policy 'signum'") && e.contains("registered: int8-own, local-sgd"),
        "{e}"
    );
    // built-in names and registered ones are not taken twice
    let e = registry.register("zero1", |_| unreachable!()).unwrap_err().to_string();
    assert!(e.contains("'zero1' is taken"), "{e}");
    assert!(registry.register("int8-own", |_| unreachable!()).is_err());
    assert!(registry.register("int8", |_| unreachable!()).is_err());
}
