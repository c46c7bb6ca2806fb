//! `brigade bench fit`: the largest member of a GPT family of many equal blocks
//! ([`GptFamily`]) that trains under a memory budget per rank with plain DDP, against the
//! largest with ZeRO-3 and every block checkpointed, found by measurement: each candidate
//! width trains a few steps on thread ranks (AdamW), its peak is read from the memory meter,
//! and the width is bisected (the peak grows with it). Two peaks are read: the whole run's
//! (the model's, optimizer's and DDP's construction included: what a run needs to start) and
//! the steady one (the most over the steps); the ZeRO-3 search is made on each.

use std::collections::HashMap;

use crate::report::stdout::outln;
use brigade::launch::LaunchConfig;
use brigade::models::{Dataset, Gpt, GptFamily, Model};
use brigade::policies::PolicySpec;
use brigade::{fit, OptimizerConfig, TrainConfig};
use clap::Args;

use crate::args::MAX_THREAD_RANKS;
use crate::error::{Error, Result};

/// Options of `brigade bench fit`.
#[derive(Args, Clone, Debug)]
pub struct FitArgs {
    /// Memory budget per rank in MiB: a member fits when its measured peak is at most this.
    #[arg(long)]
    pub budget_mib: f64,
    /// Thread ranks.
    #[arg(long, default_value_t = 4)]
    pub world_size: usize,
    /// Blocks of every member (40 or more keeps one block a small part of the model).
    #[arg(long, default_value_t = 48)]
    pub blocks: usize,
    /// Attention heads; the width moves in steps of this.
    #[arg(long, default_value_t = 2)]
    pub heads: usize,
    /// Positions per row.
    #[arg(long, default_value_t = 32)]
    pub context: usize,
    /// Rows per rank per step.
    #[arg(long, default_value_t = 1)]
    pub batch_size: usize,
    /// Steps each candidate trains (at least 2: the first step's transients and a steady one).
    #[arg(long, default_value_t = 3)]
    pub steps: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// The widest member searched: a run this wide is far past any budget this bench serves.
const MAX_WIDTH: usize = 1 << 14;

/// One candidate's measured peaks (rank 0's, in bytes).
#[derive(Clone, Copy, Debug)]
struct Peaks {
    /// From the model's construction to the last step.
    whole: usize,
    /// The most over the steps.
    steady: usize,
}

/// The two ways a member trains here.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Way {
    /// Plain DDP (all-reduce), nothing checkpointed.
    Plain,
    /// ZeRO-3 with every block checkpointed.
    Zero3,
}

/// Runs `brigade bench fit`.
pub fn bench_fit(a: FitArgs) -> Result<()> {
    check(&a)?;
    let family = GptFamily {
        blocks: a.blocks,
        heads: a.heads,
        context: a.context,
        ..GptFamily::default()
    };
    let budget = (a.budget_mib * (1u64 << 20) as f64) as usize;
    let mut seen: HashMap<(Way, usize), Peaks> = HashMap::new();
    let mut peaks = |way: Way, width: usize| -> Result<Peaks> {
        if let Some(p) = seen.get(&(way, width)) {
            return Ok(*p);
        }
        let p = measure(&a, &family, way, width)?;
        if !a.json {
            eprintln!(
                "  {way:?} width {width}: {} parameters, peak {:.2} MiB whole run, {:.2} MiB steady",
                family.parameters(width),
                mib(p.whole),
                mib(p.steady)
            );
        }
        seen.insert((way, width), p);
        Ok(p)
    };
    let plain = largest(a.heads, |w| Ok(peaks(Way::Plain, w)?.whole <= budget))?;
    let z3_whole = largest(a.heads, |w| Ok(peaks(Way::Zero3, w)?.whole <= budget))?;
    let z3_steady = largest(a.heads, |w| Ok(peaks(Way::Zero3, w)?.steady <= budget))?;
    report(&a, &family, &seen, [plain, z3_whole, z3_steady]);
    Ok(())
}

/// Prints the search's outcome: the widest plain DDP member, the widest ZeRO-3 member on the
/// whole-run and on the steady peak, their measured peaks and the ratios of their parameters.
fn report(a: &FitArgs, family: &GptFamily, seen: &HashMap<(Way, usize), Peaks>, found: [Option<usize>; 3]) {
    let [plain, z3_whole, z3_steady] = found;
    let params = |w: Option<usize>| w.map(|w| family.parameters(w));
    let ratio = |z: Option<usize>| match (params(plain), params(z)) {
        (Some(p), Some(z)) => Some(z as f64 / p as f64),
        _ => None,
    };
    let peak_of = |way: Way, w: Option<usize>| w.and_then(|w| seen.get(&(way, w)).copied());
    if a.json {
        let row = |way: Way, w: Option<usize>| {
            serde_json::json!({
                "width": w, "parameters": params(w),
                "whole_run_peak_bytes": peak_of(way, w).map(|p| p.whole),
                "steady_peak_bytes": peak_of(way, w).map(|p| p.steady),
            })
        };
        let out = serde_json::json!({
            "budget_mib": a.budget_mib, "world_size": a.world_size, "blocks": a.blocks,
            "heads": a.heads, "context": a.context, "batch_size": a.batch_size, "steps": a.steps,
            "plain": row(Way::Plain, plain),
            "zero_3_whole_run": row(Way::Zero3, z3_whole),
            "zero_3_steady": row(Way::Zero3, z3_steady),
            "ratio_whole_run": ratio(z3_whole), "ratio_steady": ratio(z3_steady),
            "runs": seen.len(),
        });
        outln!("{out}");
        return;
    }
    outln!(
        "GPT family of {} blocks ({} heads, context {}, batch {} per rank), world {}, budget {} MiB per rank:",
        a.blocks,
        a.heads,
        a.context,
        a.batch_size,
        a.world_size,
        a.budget_mib
    );
    let line = |what: &str, way: Way, w: Option<usize>| match (w, peak_of(way, w)) {
        (Some(w), Some(p)) => format!(
            "  {what}: width {w}, {} parameters (peak {:.2} MiB whole run, {:.2} MiB steady)",
            family.parameters(w),
            mib(p.whole),
            mib(p.steady)
        ),
        _ => format!("  {what}: no member fits"),
    };
    outln!("{}", line("plain DDP, whole-run peak", Way::Plain, plain));
    outln!(
        "{}",
        line("ZeRO-3 + checkpointing, whole-run peak", Way::Zero3, z3_whole)
    );
    outln!("{}", line("ZeRO-3 + checkpointing, steady peak", Way::Zero3, z3_steady));
    let shown = |r: Option<f64>| r.map_or("-".to_string(), |r| format!("{r:.2}x"));
    outln!(
        "  ratio of parameters, ZeRO-3 / plain: {} on the whole-run peak, {} on the steady peak ({} runs)",
        shown(ratio(z3_whole)),
        shown(ratio(z3_steady)),
        seen.len()
    );
}

fn check(a: &FitArgs) -> Result<()> {
    let bad = |m: String| Err(Error::Usage(m));
    if !(a.budget_mib.is_finite() && a.budget_mib > 0.0) {
        return bad(format!(
            "--budget-mib must be a positive number of MiB, got {}",
            a.budget_mib
        ));
    }
    if a.world_size == 0 || a.world_size > MAX_THREAD_RANKS {
        return bad(format!(
            "--world-size must be between 1 and {MAX_THREAD_RANKS} (thread ranks), got {}",
            a.world_size
        ));
    }
    let positive = [
        ("--blocks", a.blocks),
        ("--heads", a.heads),
        ("--context", a.context),
        ("--batch-size", a.batch_size),
    ];
    if let Some((flag, _)) = positive.iter().find(|(_, v)| *v == 0) {
        return bad(format!("{flag} must be positive"));
    }
    if a.steps < 2 {
        return bad(format!(
            "--steps must be at least 2 (the first step and a steady one), got {}",
            a.steps
        ));
    }
    Ok(())
}

/// The widest multiple of `step` for which `fits` holds (`None`: not even `step`), assuming
/// that a member that fits leaves every narrower one fitting: doubling to a width that does
/// not fit, then bisecting between.
fn largest(step: usize, mut fits: impl FnMut(usize) -> Result<bool>) -> Result<Option<usize>> {
    if !fits(step)? {
        return Ok(None);
    }
    let (mut lo, mut hi) = (1usize, 2usize); // in steps: lo fits, hi is to be tried
    while fits(hi * step)? {
        lo = hi;
        hi *= 2;
        if hi * step > MAX_WIDTH {
            return Err(Error::Usage(format!(
                "a member {} wide still fits the budget: give a smaller --budget-mib",
                lo * step
            )));
        }
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid * step)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(Some(lo * step))
}

/// Trains the member `width` wide `a.steps` steps the `way` given; rank 0's peaks.
fn measure(a: &FitArgs, family: &GptFamily, way: Way, width: usize) -> Result<Peaks> {
    let mut c = TrainConfig::new(a.steps, a.batch_size, OptimizerConfig::adamw(1e-3, None));
    c.model.name = "gpt".into();
    c.model.activation_checkpointing = usize::from(way == Way::Zero3);
    c.runtime.compute_threads = Some(1);
    c.distributed.get_or_insert_default().policy = std::sync::Arc::new(match way {
        Way::Plain => PolicySpec::AllReduce,
        Way::Zero3 => PolicySpec::Zero3,
    });
    let member = family.member(width);
    let context = a.context;
    let r = fit(
        &LaunchConfig::threads(a.world_size),
        &c,
        |_| Dataset::builtin_text(context, 0).map_err(Into::into),
        |_| Ok(Box::new(Gpt::new(member.clone(), 0)?) as Box<dyn Model>),
    )?;
    let m = r
        .outcome
        .memory
        .ok_or_else(|| Error::Usage("the run reported no memory (no step ran)".into()))?;
    Ok(Peaks {
        whole: m.peak.max(m.construction_peak),
        steady: m.peak,
    })
}

fn mib(b: usize) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_search_finds_the_widest_multiple_that_fits() {
        for limit in [0, 1, 2, 3, 7, 8, 9, 100, 1000] {
            let mut tried = vec![];
            let got = largest(2, |w| {
                tried.push(w);
                Ok(w <= limit)
            })
            .unwrap();
            let want = (limit >= 2).then_some(limit / 2 * 2);
            assert_eq!(got, want, "limit {limit}, tried {tried:?}");
            assert!(tried.len() <= 2 * 10, "{tried:?}");
        }
    }
}
