//! Where the command line meets the library's configuration, in one place: the flag of each
//! configuration field the library's messages name ([`FIELD_FLAGS`], [`in_flag_terms`]), and
//! a plan's candidate as the arguments of `brigade train` ([`plan_command`]).

use brigade::ddp::overlap::LinkCost;
use brigade::field;
use brigade::plan::{Candidate, Plan};

/// The flag (or the command) that sets each configuration field the library's messages name.
pub const FIELD_FLAGS: [(&str, &str); 11] = [
    (field::FIRST_BUCKET_CAP, "--first-bucket-mb"),
    (field::BUCKET_CAP, "--bucket-mb"),
    (field::REDUCE_DTYPE, "--reduce-dtype"),
    (field::DECAY_STEPS, "--lr-decay-steps"),
    (field::PROFILE, "brigade train --profile"),
    (field::PRECISION, "--precision"),
    (field::DEVICE, "--device"),
    (field::POLICY, "--policy"),
    (field::JOIN, "--join"),
    (brigade::checkpoint_files::PATH_FIELD, "--checkpoint"),
    (brigade::checkpoint_files::INIT_FIELD, "--init"),
];

/// The flag that sets configuration field `field` ([`FIELD_FLAGS`]); a field of no flag there
/// is a setting of its own (a policy's, `powersgd_rank`) whose flag is its name in dashes
/// (`--powersgd-rank`).
pub fn flag_of(field: &str) -> String {
    match FIELD_FLAGS.iter().find(|(f, _)| *f == field) {
        Some((_, flag)) => flag.to_string(),
        None => format!("--{}", field.replace('_', "-")),
    }
}

/// `message` of the library with every configuration field it names said as its flag.
pub fn in_flag_terms(message: &str) -> String {
    // longest paths first: `recipe.precision` is the start of `recipe.precision.reduce_dtype`
    let mut fields = FIELD_FLAGS;
    fields.sort_by_key(|(f, _)| std::cmp::Reverse(f.len()));
    fields
        .iter()
        .fold(message.to_string(), |m, (f, flag)| m.replace(f, flag))
}

/// Flags of `brigade train` that a plan's command sets (or drops: the older spellings of the
/// policy and its settings, the profiling), each with whether it takes a value
/// (`--activation-checkpointing` may take one).
fn planned_flags() -> Vec<(String, bool)> {
    let fixed = [
        ("--policy", true),
        ("--comm-hook", true),
        ("--zero", true),
        ("--bucket-mb", true),
        ("--first-bucket-mb", true),
        ("--activation-checkpointing", false),
        ("--world-size", true),
        ("--profile", true),
        ("--profile-steps", true),
    ];
    let settings = brigade::policies::POWERSGD_SETTINGS.map(|s| (flag_of(s), true));
    fixed
        .map(|(f, v)| (f.to_string(), v))
        .into_iter()
        .chain(settings)
        .collect()
}

/// The flags of the simulated link.
const LINK_FLAGS: [(&str, bool); 2] = [("--net-gbps", true), ("--net-latency-us", true)];

/// The flags that choose candidate `c`: `--policy`, `--bucket-mb`, `--first-bucket-mb`,
/// `--activation-checkpointing` (when on) and `--world-size`.
pub fn candidate_flags(c: &Candidate) -> Vec<String> {
    let mut f = vec![
        "--policy".to_string(),
        c.policy.to_string(),
        "--bucket-mb".into(),
        c.bucket_cap_mb.to_string(),
        "--first-bucket-mb".into(),
        c.first_bucket_cap_mb.to_string(),
    ];
    if c.activation_checkpointing > 0 {
        f.extend([
            "--activation-checkpointing".into(),
            c.activation_checkpointing.to_string(),
        ]);
    }
    f.extend(["--world-size".into(), c.world_size.to_string()]);
    f
}

/// The flags of `link` (none for the measured link).
pub fn link_flags(link: &LinkCost) -> Vec<String> {
    match link {
        LinkCost::Ring(m) => vec![
            "--net-gbps".into(),
            (m.bandwidth_bytes_per_s * 8.0 / 1e9).to_string(),
            "--net-latency-us".into(),
            (m.latency.as_nanos() as f64 / 1e3).to_string(),
        ],
        LinkCost::Measured => vec![],
    }
}

/// The command line that runs candidate `idx` of `plan`: the profiled command with the flags
/// the plan chooses (and `--profile`, `--profile-steps`) replaced by [`candidate_flags`], and
/// its link by the one the plan costed; the flags alone when no profile recorded a command (a
/// library run).
pub fn plan_command(plan: &Plan, idx: usize) -> Vec<String> {
    let mut out = without(&plan.command, !link_flags(&plan.link).is_empty());
    out.extend(candidate_flags(&plan.candidates[idx]));
    out.extend(link_flags(&plan.link));
    out
}

/// `command` without the flags a plan sets (and the link's when `link`), with their values.
fn without(command: &[String], link: bool) -> Vec<String> {
    let link: &[(&str, bool)] = if link { &LINK_FLAGS } else { &[] };
    let planned = planned_flags();
    let mut out = vec![];
    let mut args = command.iter().peekable();
    while let Some(a) = args.next() {
        let (name, inline) = match a.split_once('=') {
            Some((n, _)) if n.starts_with("--") => (n, true),
            _ => (a.as_str(), false),
        };
        let mut flags = planned
            .iter()
            .map(|(f, v)| (f.as_str(), *v))
            .chain(link.iter().copied());
        match flags.find(|(f, _)| *f == name) {
            None => out.push(a.clone()),
            Some(_) if inline => {}
            Some((_, true)) => {
                args.next();
            }
            // an optional value: a number right after it
            Some((_, false)) => {
                if args.peek().is_some_and(|v| v.parse::<usize>().is_ok()) {
                    args.next();
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use brigade::launch::net_model;
    use brigade::plan::memory::PeakPrediction;
    use brigade::policies::PolicySpec;

    use super::*;

    fn plan(command: &str, link: LinkCost, ac: usize) -> Plan {
        let memory = PeakPrediction {
            parameters: 0,
            gradients: 0,
            optimizer_state: 0,
            activations: 0,
            backward: 0,
            policy_state: 0,
        };
        Plan {
            candidates: vec![Candidate {
                policy: PolicySpec::Fp16,
                bucket_cap_mb: 5.0,
                first_bucket_cap_mb: 1.0,
                activation_checkpointing: ac,
                world_size: 2,
                memory,
                over_budget: None,
                step: Err(String::new()),
            }],
            winner: Some(0),
            precision: "f32".into(),
            command: command.split(' ').filter(|s| !s.is_empty()).map(String::from).collect(),
            notes: vec![],
            link,
        }
    }

    #[test]
    fn the_winners_command_parses_back_into_the_chosen_flags() {
        let argv =
            "brigade train --model gpt --comm-hook fp16 --powersgd-rank 2 --zero 0 --bucket-mb=25 --first-bucket-mb 1 \
                    --activation-checkpointing --world-size 2 --profile p.json --profile-steps 1..3 --steps 3 \
                    --net-gbps 10 --net-latency-us=5";
        for ac in [0, 1] {
            let p = plan(argv, LinkCost::Ring(net_model(1.0, 20.0)), ac);
            let c = &p.candidates[0];
            let cmd = plan_command(&p, 0);
            let value = |flag: &str| -> Vec<&str> {
                cmd.iter()
                    .enumerate()
                    .filter(|(_, a)| a.as_str() == flag)
                    .map(|(i, _)| cmd.get(i + 1).map_or("", String::as_str))
                    .collect()
            };
            assert_eq!(&cmd[..4], ["brigade", "train", "--model", "gpt"], "{cmd:?}");
            assert_eq!(value("--policy").len(), 1, "{cmd:?}");
            assert_eq!(value("--policy")[0].parse::<PolicySpec>().unwrap(), c.policy);
            assert_eq!(value("--bucket-mb")[0].parse::<f64>().unwrap(), c.bucket_cap_mb);
            assert_eq!(
                value("--first-bucket-mb")[0].parse::<f64>().unwrap(),
                c.first_bucket_cap_mb
            );
            assert_eq!(value("--world-size"), ["2"]);
            let ac = value("--activation-checkpointing");
            assert_eq!(ac.len(), usize::from(c.activation_checkpointing > 0), "{cmd:?}");
            for gone in [
                "--comm-hook",
                "--powersgd-rank",
                "--zero",
                "--profile",
                "--profile-steps",
            ] {
                assert!(value(gone).is_empty(), "{gone} in {cmd:?}");
            }
            assert!(!cmd.iter().any(|a| a.starts_with("--bucket-mb=")), "{cmd:?}");
            assert_eq!(value("--steps"), ["3"]);
            // the link the plan costed (1 Gb/s, 20 us), not the profiled run's 10 Gb/s, 5 us
            assert_eq!(
                (value("--net-gbps"), value("--net-latency-us")),
                (vec!["1"], vec!["20"]),
                "{cmd:?}"
            );
            assert!(!cmd.iter().any(|a| a.starts_with("--net-latency-us=")), "{cmd:?}");
        }
        // a library profile has no command: the flags alone, and the link's
        let lib = plan("", LinkCost::Ring(net_model(1.0, 20.0)), 0);
        let flags = [candidate_flags(&lib.candidates[0]), link_flags(&lib.link)].concat();
        assert_eq!(plan_command(&lib, 0), flags);
        assert_eq!(plan_command(&lib, 0)[0], "--policy");
        // on the profiles' measured link the profiled run's link flags stay as they were
        let cmd = plan_command(&plan(argv, LinkCost::Measured, 0), 0);
        assert!(
            cmd.iter().any(|a| a == "--net-gbps") && cmd.iter().any(|a| a == "--net-latency-us=5"),
            "{cmd:?}"
        );
    }

    #[test]
    fn library_messages_name_flags_in_place_of_fields() {
        let m = format!(
            "{} bf16: beside fp16 parameters; {} f32 defeats it; use {} cpu; {} divide-initial; re-record it with this build's {}",
            field::REDUCE_DTYPE,
            field::PRECISION,
            field::DEVICE,
            field::JOIN,
            field::PROFILE
        );
        assert_eq!(
            in_flag_terms(&m),
            "--reduce-dtype bf16: beside fp16 parameters; --precision f32 defeats it; use --device cpu; \
             --join divide-initial; re-record it with this build's brigade train --profile"
        );
        assert_eq!(flag_of("powersgd_rank"), "--powersgd-rank");
        assert_eq!(flag_of(field::DECAY_STEPS), "--lr-decay-steps");
    }
}
