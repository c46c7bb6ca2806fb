//! `--timeline FILE.json`: one training step per rank as a Chrome trace, and the same
//! step drawn as a Gantt chart (`FILE.svg`): per rank a compute lane and a comm lane.

use std::path::Path;
use std::time::Instant;

use brigade::ddp::Phase;
use brigade_comm::{chrome_trace, EventKind, TraceEvent, Track};
use plotters::prelude::*;

use crate::error::{Error, Result};
use crate::outputs::write_atomic;

/// Writes `events` as Chrome trace JSON to `path` and a Gantt chart beside it (`.svg`).
pub fn write_timeline(path: &Path, events: &[TraceEvent], origin: Instant, title: &str) -> Result<()> {
    let json = chrome_trace(events, origin);
    let text = serde_json::to_string(&json).map_err(|e| Error::json("timeline JSON", e))?;
    write_atomic(path, text.as_bytes())?;
    draw_gantt(&path.with_extension("svg"), events, title)
}

/// A span worth drawing: leaves only (not the enclosing step).
fn drawable(e: &TraceEvent) -> bool {
    !matches!(Phase::of(&e.kind), Some(Phase::Step(_)))
}

/// The chart colour of an event's kind.
fn color_for(e: &TraceEvent) -> RGBColor {
    if let EventKind::Collective { .. } = e.kind {
        return RGBColor(230, 126, 34);
    }
    match Phase::of(&e.kind) {
        Some(Phase::Forward) => RGBColor(52, 152, 219),
        Some(Phase::Optimizer) => RGBColor(39, 174, 96),
        Some(Phase::WaitForBuckets) => RGBColor(160, 160, 160),
        Some(Phase::Backward { scope }) => {
            // backward spans alternate two purples so adjacent layers stay apart
            let n: usize = scope.as_deref().unwrap_or("").bytes().map(usize::from).sum();
            if n.is_multiple_of(2) {
                RGBColor(142, 68, 173)
            } else {
                RGBColor(187, 143, 206)
            }
        }
        Some(Phase::Step(_) | Phase::Other(_)) | None => RGBColor(120, 120, 120),
    }
}

/// What each colour of the chart means, in the order a step runs (the same colours as
/// [`color_for`]).
const LEGEND: [(&str, RGBColor); 6] = [
    ("forward", RGBColor(52, 152, 219)),
    ("backward, per layer", RGBColor(142, 68, 173)),
    ("(next layer)", RGBColor(187, 143, 206)),
    ("waiting", RGBColor(160, 160, 160)),
    ("optimizer", RGBColor(39, 174, 96)),
    ("all-reduce (comm stream)", RGBColor(230, 126, 34)),
];

/// Height in pixels of the legend strip under the chart.
const LEGEND_HEIGHT: u32 = 30;

/// One row of colour swatches with their meaning.
fn draw_legend<DB: DrawingBackend>(area: &DrawingArea<DB, plotters::coord::Shift>) -> std::result::Result<(), String> {
    let mut x = 170;
    for (label, color) in LEGEND {
        area.draw(&Rectangle::new([(x, 8), (x + 14, 22)], color.filled()))
            .map_err(|e| e.to_string())?;
        area.draw(&Text::new(label, (x + 19, 9), ("sans-serif", 13).into_font()))
            .map_err(|e| e.to_string())?;
        x += 40 + 7 * label.len() as i32;
    }
    Ok(())
}

/// Draws one lane pair per rank: compute (forward, backward per layer, optimizer) and
/// the comm stream (each bucket's all-reduce), time in ms from the step's start.
fn draw_gantt(path: &Path, events: &[TraceEvent], title: &str) -> Result<()> {
    // drawn into memory, then written atomically like every other output
    let mut svg = String::new();
    render_gantt(&mut svg, path, events, title)?;
    write_atomic(path, svg.as_bytes())
}

/// The chart of [`draw_gantt`] as SVG text (`path` names it in errors).
fn render_gantt(svg: &mut String, path: &Path, events: &[TraceEvent], title: &str) -> Result<()> {
    let err = |msg: String| Error::Chart {
        path: path.display().to_string(),
        msg,
    };
    let spans: Vec<&TraceEvent> = events
        .iter()
        .filter(|e| e.start.is_some() && e.end.is_some() && drawable(e))
        .collect();
    let Some(t0) = events.iter().filter_map(|e| e.issued.or(e.start)).map(|s| s.at).min() else {
        return Err(err("no events were recorded for the timeline".into()));
    };
    let ms = |t: Instant| t.saturating_duration_since(t0).as_secs_f64() * 1e3;
    let t_end = spans
        .iter()
        .map(|e| ms(e.end.expect("filtered").at))
        .fold(0.0, f64::max)
        .max(1e-3);
    let mut ranks: Vec<usize> = spans.iter().map(|e| e.rank).collect();
    ranks.sort_unstable();
    ranks.dedup();
    let lanes = 2 * ranks.len().max(1);
    // lane 0 is drawn at the top: rank 0 compute, rank 0 comm, rank 1 compute, ...
    let lane_of =
        |e: &TraceEvent| 2 * ranks.iter().position(|&r| r == e.rank).unwrap_or(0) + usize::from(e.track == Track::Comm);
    let y_of = |lane: usize| (lanes - 1 - lane) as f64;
    let height = 120 + 70 * lanes as u32 + LEGEND_HEIGHT;
    let root = SVGBackend::with_string(svg, (1400, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let (upper, legend) = root.split_vertically(height - LEGEND_HEIGHT);
    draw_legend(&legend).map_err(err)?;
    let mut chart = ChartBuilder::on(&upper)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(150)
        .build_cartesian_2d(0.0..t_end * 1.02, 0.0..lanes as f64)
        .map_err(|e| err(e.to_string()))?;
    let lane_label = |y: &f64| {
        let lane = lanes - 1 - (*y as usize).min(lanes - 1);
        let rank = ranks.get(lane / 2).copied().unwrap_or(0);
        format!(
            "rank {rank} {}",
            if lane.is_multiple_of(2) {
                "compute"
            } else {
                "comm stream"
            }
        )
    };
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(lanes * 2 + 1)
        .y_label_formatter(&|y| {
            if (y.fract() - 0.5).abs() < 0.01 {
                lane_label(y)
            } else {
                String::new()
            }
        })
        .x_desc("ms since the step began")
        .draw()
        .map_err(|e| err(e.to_string()))?;
    for e in &spans {
        let (a, b) = (ms(e.start.expect("filtered").at), ms(e.end.expect("filtered").at));
        draw_span(&mut chart, e, y_of(lane_of(e)), (a, b), t_end).map_err(err)?;
    }
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}

/// One span of the Gantt chart: its bar from `a` to `b` ms on `lane`, and its name when the
/// reader looks for it (every bucket) or when the bar is wide enough to hold it.
fn draw_span<DB: DrawingBackend>(
    chart: &mut ChartContext<
        '_,
        DB,
        Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
    >,
    e: &TraceEvent,
    lane: f64,
    (a, b): (f64, f64),
    t_end: f64,
) -> std::result::Result<(), String> {
    chart
        .draw_series(std::iter::once(Rectangle::new(
            [(a, lane + 0.15), (b.max(a + t_end * 1e-3), lane + 0.85)],
            color_for(e).filled(),
        )))
        .map_err(|e| e.to_string())?;
    let label = match Phase::of(&e.kind) {
        Some(Phase::Backward { scope }) => scope.unwrap_or_else(|| "loss".to_string()),
        _ => e.name.clone(),
    };
    // Every bucket is named (the comm lane is sparse, and the buckets are what a reader
    // looks for); compute spans only when wide enough to hold the name.
    if e.track == Track::Comm || (b - a) / t_end > 0.004 * label.len() as f64 {
        chart
            .draw_series(std::iter::once(Text::new(
                label,
                (a + t_end * 0.002, lane + 0.45),
                ("sans-serif", 11).into_font(),
            )))
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}
