//! `brigade predict`: replay a recorded step (`brigade train --profile`) under other bucket
//! caps, links and world sizes, without running anything (the overlap model,
//! `brigade_ddp::overlap`).

use crate::report::stdout::outln;
use std::io::Read;
use std::path::{Path, PathBuf};

use brigade_ddp::overlap::{
    measured_link, replay_with, BucketOrder, LaunchCost, LaunchOverhead, LinkCost, ReplayConfig, ReplayResult,
    StepProfile,
};
use clap::Args;

use crate::args::check_link;
use crate::error::{Error, Result};

/// Largest `--world-size` to predict for.
pub(crate) const MAX_WORLD: usize = 1 << 20;

/// Options of `brigade predict`.
#[derive(Args, Clone, Debug)]
pub struct PredictArgs {
    /// A step profile written by `brigade train --profile`.
    #[arg(long)]
    pub profile: PathBuf,
    /// Bucket caps to predict, in MiB.
    #[arg(long, value_delimiter = ',', default_value = "0.25,1,5,25,100")]
    pub bucket_mb: Vec<f64>,
    /// The first bucket's cap in MiB (default 1), never above the bucket cap (as `brigade train`).
    #[arg(long)]
    pub first_bucket_mb: Option<f64>,
    /// The link to cost the collectives on.
    #[command(flatten)]
    pub link: LinkArgs,
    /// Cost the collectives for this many ranks (default: the profile's).
    #[arg(long)]
    pub world_size: Option<usize>,
    /// Print the predictions as JSON.
    #[arg(long)]
    pub json: bool,
}

/// The link `brigade predict` and `brigade plan` cost collectives on: a ring of simulated links,
/// or the one the profiled runs had (exactly one).
#[derive(Args, Clone, Debug)]
pub struct LinkArgs {
    /// A ring of links of this many gigabits per second (with --net-latency-us).
    #[arg(long)]
    pub net_gbps: Option<f64>,
    /// Latency per message of those links, in microseconds.
    #[arg(long, default_value_t = 0.0)]
    pub net_latency_us: f64,
    /// The link the profiled runs had, fitted from their recorded buckets (instead of
    /// --net-gbps).
    #[arg(long)]
    pub measured_link: bool,
}

impl LinkArgs {
    /// The link `--net-gbps G [--net-latency-us L]` or `--measured-link` names.
    pub fn cost(&self) -> Result<LinkCost> {
        let (net_gbps, net_latency_us) = (self.net_gbps, self.net_latency_us);
        let bad = |m: String| Err(Error::Usage(m));
        match (net_gbps, self.measured_link) {
            (Some(_), true) => bad("--net-gbps and --measured-link name two links: pick one".into()),
            (None, false) => {
                bad("say which link to predict for: --net-gbps G [--net-latency-us L], or --measured-link".into())
            }
            (None, true) if net_latency_us != 0.0 => bad(format!(
            "--net-latency-us {net_latency_us} goes with --net-gbps; --measured-link fits the latency from the profile"
        )),
            (None, true) => Ok(LinkCost::Measured),
            (Some(g), false) => {
                check_link(Some(g), net_latency_us)?;
                Ok(LinkCost::Ring(brigade::launch::net_model(g, net_latency_us)))
            }
        }
    }
}

/// Checks `--world-size` (when given) and the caps of `--bucket-mb` and `--first-bucket-mb`.
pub fn check_caps_and_world(bucket_mb: &[f64], first_bucket_mb: Option<f64>, world: Option<usize>) -> Result<()> {
    if let Some(n) = world.filter(|n| !(1..=MAX_WORLD).contains(n)) {
        return Err(Error::Usage(format!(
            "--world-size must be between 1 and {MAX_WORLD}, got {n}"
        )));
    }
    if let Some(c) = bucket_mb
        .iter()
        .chain(&first_bucket_mb)
        .find(|&&c| !crate::args::cap_in_range(c))
    {
        return Err(Error::Usage(format!(
            "--bucket-mb and --first-bucket-mb must be finite, at least one byte ({:e}) and at most {}, got {}",
            crate::args::MIN_BUCKET_MB,
            crate::args::MAX_BUCKET_MB,
            if c.is_finite() && c.abs() < 1e7 {
                c.to_string()
            } else {
                format!("{c:e}")
            }
        )));
    }
    if let Some(c) = crate::args::listed_twice(bucket_mb) {
        return Err(Error::Usage(format!(
            "--bucket-mb lists {c} twice: each cap is one row"
        )));
    }
    Ok(())
}

/// The step profiles of the file at `path`: one step (`--profile`) or a list of steps
/// (`--profile-steps`); one line when it is neither.
pub fn read_profiles(path: &Path) -> Result<Vec<StepProfile>> {
    let text = read_profile(path)?;
    let not_a_profile = |e: serde_json::Error| {
        let at = json_path_at(&text, e.line(), e.column());
        let field = if at.is_empty() {
            String::new()
        } else {
            format!("field `{at}`: ")
        };
        Error::Usage(format!(
            "{}: not a step profile (written by brigade train --profile): {field}{e}",
            path.display()
        ))
    };
    // a list of steps (--profile-steps) or one step, told by the first character: the error is
    // the reading of what the file holds
    let mut list = read_list(&text, path, not_a_profile)?;
    list.iter_mut().for_each(brigade::policies::name_default_policy);
    Ok(list)
}

/// The profiles `text` (read from `path`) holds: a list of steps or one step.
fn read_list(text: &str, path: &Path, not_a_profile: impl Fn(serde_json::Error) -> Error) -> Result<Vec<StepProfile>> {
    if text.trim_start().starts_with('[') {
        match serde_json::from_str::<Vec<StepProfile>>(text) {
            Ok(list) if !list.is_empty() => Ok(list),
            Ok(_) => Err(Error::Usage(format!(
                "{}: not a step profile (written by brigade train --profile): an empty list",
                path.display()
            ))),
            Err(e) => Err(not_a_profile(e)),
        }
    } else {
        serde_json::from_str::<StepProfile>(text)
            .map(|p| vec![p])
            .map_err(not_a_profile)
    }
}

/// The path (`[1].ranks[0].buckets`) of the value that JSON `text` stands in at one-based
/// `line` and `column` (where serde_json places an error): the keys and indices of the objects
/// and lists open there; empty at the top.
fn json_path_at(text: &str, line: usize, column: usize) -> String {
    enum Open {
        Object { key: Option<String>, expects_key: bool },
        List { index: usize },
    }
    let line_start: usize = text
        .split_inclusive('\n')
        .take(line.saturating_sub(1))
        .map(str::len)
        .sum();
    let end = (line_start + column).min(text.len());
    let bytes = text.as_bytes();
    let mut open: Vec<Open> = vec![];
    let mut i = 0;
    while i < end {
        match bytes[i] {
            b'{' => open.push(Open::Object {
                key: None,
                expects_key: true,
            }),
            b'[' => open.push(Open::List { index: 0 }),
            b'}' | b']' => {
                open.pop();
            }
            b',' => match open.last_mut() {
                Some(Open::Object { key, expects_key }) => (*key, *expects_key) = (None, true),
                Some(Open::List { index }) => *index += 1,
                None => {}
            },
            b':' => {
                if let Some(Open::Object { expects_key, .. }) = open.last_mut() {
                    *expects_key = false;
                }
            }
            b'"' => {
                let start = i + 1;
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
                // a key cut off by the end of the file names nothing yet
                if let (Some(Open::Object { key, expects_key: true }), true) = (open.last_mut(), i < bytes.len()) {
                    *key = text.get(start..i).filter(|k| !k.is_empty()).map(str::to_string);
                }
            }
            _ => {}
        }
        i += 1;
    }
    let mut path = String::new();
    for o in &open {
        match o {
            Open::Object { key: Some(k), .. } => {
                if !path.is_empty() {
                    path.push('.');
                }
                path.push_str(k);
            }
            Open::Object { key: None, .. } => {}
            Open::List { index } => path.push_str(&format!("[{index}]")),
        }
    }
    path
}

/// Largest profile file `brigade predict` reads (a step profile is kilobytes; a list of
/// thousands of steps, megabytes).
const MAX_PROFILE_BYTES: u64 = 256 << 20;

/// The text of the profile file at `path` (`--profile`), reading at most
/// [`MAX_PROFILE_BYTES`]: a device (`/dev/zero`), a directory or a larger file is refused
/// before it is read; a pipe is read up to the bound.
fn read_profile(path: &Path) -> Result<String> {
    let io = |source| Error::Io {
        path: path.display().to_string(),
        source,
    };
    let not_a_profile = |why: String| {
        Error::Usage(format!(
            "{}: not a step profile (written by brigade train --profile): {why}",
            path.display()
        ))
    };
    let kind = std::fs::metadata(path).map_err(io)?;
    crate::outputs::check_is_file("--profile", path, &kind, true)?;
    if kind.len() > MAX_PROFILE_BYTES {
        return Err(not_a_profile(format!(
            "it is {} bytes, larger than {} MiB",
            kind.len(),
            MAX_PROFILE_BYTES >> 20
        )));
    }
    let mut bytes = vec![];
    std::fs::File::open(path)
        .map_err(io)?
        .take(MAX_PROFILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(io)?;
    if bytes.len() as u64 > MAX_PROFILE_BYTES {
        return Err(not_a_profile(format!(
            "it is larger than {} MiB",
            MAX_PROFILE_BYTES >> 20
        )));
    }
    String::from_utf8(bytes).map_err(|_| not_a_profile("it is not text".into()))
}

/// Runs `brigade predict`.
pub fn predict(a: PredictArgs) -> Result<()> {
    let link = a.link.cost()?;
    check_caps_and_world(&a.bucket_mb, a.first_bucket_mb, a.world_size)?;
    let profiles = read_profiles(&a.profile)?;
    let profile = &profiles[0];
    if let Some((i, p)) = profiles
        .iter()
        .enumerate()
        .find(|(_, p)| p.world_size != profile.world_size)
    {
        return Err(Error::Usage(format!(
            "{}: step {i} of the list recorded {} ranks, step 0 {}: one run's steps, please",
            a.profile.display(),
            p.world_size,
            profile.world_size
        )));
    }
    // the backend's launch overhead and the measured link, fitted once from every recorded step
    let overhead = LaunchOverhead::fit(&profiles.iter().collect::<Vec<_>>());
    let links = match link {
        LinkCost::Measured => measured_links(&a.profile, &profiles)?,
        ring => vec![ring; profiles.len()],
    };
    let mut rows = vec![];
    for &cap in &a.bucket_mb {
        let cfg = ReplayConfig {
            bucket_cap_mb: cap,
            first_bucket_cap_mb: a.first_bucket_mb.unwrap_or(1.0).min(cap),
            link: links[0],
            world_size: a.world_size,
            order: BucketOrder::recorded(&profiles[0]),
        };
        let mut steps = profiles
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let cfg = ReplayConfig { link: links[i], ..cfg };
                replay_with(p, &cfg, overhead).map_err(|e| {
                    let step = if profiles.len() > 1 {
                        format!(" (step {i} of the list)")
                    } else {
                        String::new()
                    };
                    Error::Usage(format!("{}{step}: {e}", a.profile.display()))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        // several steps: the one whose predicted step time is the median
        steps.sort_by(|x, y| x.predicted_step_s.total_cmp(&y.predicted_step_s));
        for note in steps
            .iter()
            .filter_map(|s| s.wire_note.as_ref())
            .take(usize::from(rows.is_empty()))
        {
            eprintln!("note: {note}");
        }
        rows.push(row_of(steps, profile));
    }
    if a.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&rows).map_err(|e| Error::json("the predictions", e))?
        );
    } else {
        if profiles.len() > 1 {
            outln!(
                "{} steps recorded: each row is the step with the median predicted step time (a policy that \
                 syncs after the step every few steps: the steps' mean step times)",
                profiles.len()
            );
        }
        print_table(profile, &rows);
    }
    Ok(())
}

/// The row of one cap from its replayed steps (sorted by predicted step time): the median step;
/// for a policy that communicates after the step every few steps (DiLoCo), with the steps'
/// mean predicted and compute-only step times, since one step in a period syncs and does its
/// outer step, and the others do neither.
fn row_of(mut steps: Vec<ReplayResult>, profile: &StepProfile) -> ReplayResult {
    let periodic = profile
        .policy
        .as_ref()
        .and_then(|p| p.after_step.as_ref())
        .is_some_and(|a| a.every > 1);
    let n = steps.len() as f64;
    let (predicted, compute) = steps
        .iter()
        .fold((0.0, 0.0), |(p, c), s| (p + s.predicted_step_s, c + s.compute_step_s));
    let mut row = steps.swap_remove(steps.len() / 2);
    if periodic && n > 1.0 {
        (row.predicted_step_s, row.compute_step_s) = (predicted / n, compute / n);
    }
    row
}

/// `--measured-link` for each of `profiles`: the link its own recorded collectives measured;
/// for a step that recorded none on the link (DiLoCo's steps between syncs), the link fitted to
/// every step of the list at once; when no step recorded any, the link the run's command line
/// stated, with a note. One line when it stated none.
fn measured_links(path: &Path, profiles: &[StepProfile]) -> Result<Vec<LinkCost>> {
    let usage = |e: brigade_ddp::DdpError| Error::Usage(format!("{}: {e}", path.display()));
    let own: Vec<bool> = profiles
        .iter()
        .map(|p| measured_link(&[p]).map(|m| m.is_some()))
        .collect::<std::result::Result<_, _>>()
        .map_err(usage)?;
    if own.iter().all(|&o| o) {
        return Ok(vec![LinkCost::Measured; profiles.len()]);
    }
    let joint = match measured_link(&profiles.iter().collect::<Vec<_>>()).map_err(usage)? {
        Some(m) => LinkCost::Ring(m),
        None => stated_link(path, &profiles[0])?,
    };
    Ok(own
        .into_iter()
        .map(|o| if o { LinkCost::Measured } else { joint })
        .collect())
}

/// The link a profiled run had, as its command line stated it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum RecordedLink {
    /// `--net-gbps G [--net-latency-us L]`: a simulated link.
    Simulated {
        /// Its bandwidth in Gb/s.
        gbps: f64,
        /// Its latency per message in µs.
        latency_us: f64,
    },
    /// No `--net-gbps`: the machine's own link (or the network mpirun spans).
    Own,
}

impl std::fmt::Display for RecordedLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RecordedLink::Simulated { gbps, latency_us } => write!(f, "a simulated {gbps} Gb/s, {latency_us} us link"),
            RecordedLink::Own => write!(f, "the machine's own link (no --net-gbps)"),
        }
    }
}

/// The link `profile`'s run had, read from the command line it recorded (`--net-gbps`,
/// `--net-latency-us`); `None` when it recorded none (a profile written by the library).
pub(crate) fn recorded_link(profile: &StepProfile) -> Option<RecordedLink> {
    let command = profile.run.as_ref().map_or(&[][..], |r| &r.command[..]);
    if command.is_empty() {
        return None;
    }
    let flag = |name: &str| {
        command
            .iter()
            .enumerate()
            .find_map(|(i, w)| match w.strip_prefix(name) {
                Some("") => command.get(i + 1).and_then(|v| v.parse::<f64>().ok()),
                Some(v) => v.strip_prefix('=').and_then(|v| v.parse::<f64>().ok()),
                None => None,
            })
    };
    Some(match flag("--net-gbps") {
        Some(gbps) => RecordedLink::Simulated {
            gbps,
            latency_us: flag("--net-latency-us").unwrap_or(0.0),
        },
        None => RecordedLink::Own,
    })
}

/// The link `profile`'s run stated on its command line (`--net-gbps`, `--net-latency-us`), for
/// a run that recorded nothing on the link to measure, with a note; one line when it stated
/// none.
fn stated_link(path: &Path, profile: &StepProfile) -> Result<LinkCost> {
    let why = "the profile recorded no collective on the link to measure it by";
    let Some(RecordedLink::Simulated { gbps, latency_us }) = recorded_link(profile) else {
        return Err(Error::Usage(format!(
            "{}: --measured-link: {why}, and its run stated no --net-gbps to fall back to: give --net-gbps G \
             [--net-latency-us L]",
            path.display()
        )));
    };
    eprintln!(
        "note: {}: {why}; the link its run stated is used instead ({gbps} Gb/s, {latency_us} us)",
        path.display()
    );
    check_link(Some(gbps), latency_us)?;
    Ok(LinkCost::Ring(brigade::launch::net_model(gbps, latency_us)))
}

fn print_table(profile: &StepProfile, rows: &[ReplayResult]) {
    const MIB: f64 = 1048576.0;
    let ms = |s: f64| s * 1e3;
    outln!(
        "profile: {} ranks, recorded at bucket cap {} MiB; predictions for {} ranks",
        profile.world_size,
        profile.bucket_cap_mb,
        rows.first().map_or(profile.world_size, |r| r.world_size)
    );
    if let Some(o) = rows
        .first()
        .map(|r| r.launch_overhead)
        .filter(|_| profile.world_size > 1)
    {
        let cost = |c: LaunchCost| format!("{:.3} ms + {:.3} ms/MiB", ms(c.fixed_s), ms(c.per_byte_s) * MIB);
        outln!(
            "launch overhead fitted from the recorded buckets: {} during backward, {} after",
            cost(o.during_backward),
            cost(o.after_backward)
        );
    }
    // The after-step sync (DiLoCo's outer step, a streaming fragment) is part of the step but
    // of no bucket: its column shows when some row has one, so that each row adds up.
    let sync = rows.iter().any(|r| r.after_step_comm_s > 0.0);
    let sync_ms = |v: String| if sync { format!(" {v:>8}") } else { String::new() };
    // So is the ranks' agreement on the loss, every step after the buckets.
    let agree = rows.iter().any(|r| r.agreement_comm_s > 0.0);
    let agree_ms = |v: String| if agree { format!(" {v:>9}") } else { String::new() };
    outln!(
        "{:>10} {:>7} {:>10} {:>12} {:>9} {:>11}{}{} {:>13}  exposed buckets",
        "bucket_MiB",
        "buckets",
        "step_ms",
        "compute_ms",
        "comm_ms",
        "exposed_ms",
        sync_ms("sync_ms".into()),
        agree_ms("agree_ms".into()),
        "lower_bound_ms"
    );
    for r in rows {
        let exposed: Vec<String> = r
            .buckets
            .iter()
            .enumerate()
            .filter(|(_, b)| b.exposed_s > 0.0)
            .map(|(i, b)| format!("{i} ({:.2} ms)", ms(b.exposed_s)))
            .collect();
        outln!(
            "{:>10} {:>7} {:>10.2} {:>12.2} {:>9.2} {:>11.2}{}{} {:>13.2}  {}",
            r.bucket_cap_mb,
            r.buckets.len(),
            ms(r.predicted_step_s),
            ms(r.compute_step_s),
            ms(r.comm_s),
            ms(r.exposed_comm_s),
            sync_ms(format!("{:.2}", ms(r.after_step_comm_s))),
            agree_ms(format!("{:.2}", ms(r.agreement_comm_s))),
            ms(r.lower_bound_exposed_s),
            if exposed.is_empty() {
                "none".to_string()
            } else {
                exposed.join(", ")
            }
        );
    }
    if let Some(r) = rows.first().filter(|r| !r.gathers.is_empty()) {
        let waited: Vec<String> = rows.iter().map(|r| format!("{:.2}", ms(r.exposed_gather_s))).collect();
        outln!(
            "parameter gathers: {} per step; the compute waited {:.2} ms for them in the recorded step, \
             predicted per row: {} ms",
            r.gathers.len(),
            ms(profile.gather_waited_s()),
            waited.join(", ")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::json_path_at;

    #[test]
    fn a_json_position_is_named_by_the_keys_and_indices_open_there() {
        let text = "{\n  \"a\": 1,\n  \"run\": {\"rows\": \"x\", \"m\": [1, {\"k\": tru";
        // line 2 is `  "a": 1,`, line 3 ends inside run.m[1].k
        assert_eq!(json_path_at(text, 2, 8), "a");
        assert_eq!(json_path_at(text, 3, 20), "run.rows");
        assert_eq!(json_path_at(text, 3, text.lines().nth(2).unwrap().len()), "run.m[1].k");
        assert_eq!(json_path_at(text, 1, 0), "");
        // a key cut off by the end names nothing: the object holding it is named
        assert_eq!(json_path_at("{\"run\": {\"rows\": 1, \"ro", 1, 24), "run");
        assert_eq!(json_path_at("[{}, {\"x\": [", 1, 13), "[1].x[0]");
    }
}
