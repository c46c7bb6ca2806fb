//! `--plot FILE.svg`: the training loss of every step, the validation loss on the steps it
//! was evaluated, and the learning rate (on its own axis, at the right) against the step,
//! drawn with plotters like the sweep's and the policies' charts and written atomically.

use std::path::Path;

use plotters::prelude::*;

use crate::error::{Error, Result};
use crate::outputs::write_atomic;

/// Legend text and colour of the training loss.
pub const TRAIN: (&str, RGBColor) = ("training loss", RGBColor(52, 152, 219));
/// Legend text and colour of the validation loss.
pub const VAL: (&str, RGBColor) = ("validation loss", RGBColor(231, 76, 60));
/// Legend text and colour of the learning rate.
pub const LR: (&str, RGBColor) = ("learning rate (right axis)", RGBColor(39, 174, 96));

/// One step of the chart.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossPoint {
    /// The 0-based global step.
    pub step: usize,
    /// The mean training loss over the ranks, before the step's update.
    pub loss: f64,
    /// The step's learning rate (absent in rows written before the `lr` column).
    pub lr: Option<f64>,
    /// The held-out loss after the step, on the steps it was evaluated.
    pub val_loss: Option<f64>,
}

impl LossPoint {
    /// A row of a `--losses` file (`step,loss,lr,grad_norm,val_loss`, or an older
    /// `step,loss[,lr,grad_norm]`); `None` when it is not one.
    pub fn from_csv_row(row: &str) -> Option<LossPoint> {
        let cells: Vec<&str> = row.split(',').collect();
        let cell = |i: usize| cells.get(i).and_then(|c| c.parse::<f64>().ok());
        Some(LossPoint {
            step: cells.first()?.parse().ok()?,
            loss: cell(1)?,
            lr: cell(2),
            val_loss: cell(4),
        })
    }
}

/// The range `values` span (finite ones), widened by 5% each side; `None` without any.
fn span(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if lo > hi {
        return None;
    }
    let pad = if hi > lo {
        0.05 * (hi - lo)
    } else {
        0.05 * lo.abs().max(1e-3)
    };
    Some((lo - pad, hi + pad))
}

/// Draws `points` (in step order) under `title` and writes the SVG to `path` atomically.
/// Non-finite values (a diverged step) are left out of the curves.
pub fn write_loss_chart(path: &Path, points: &[LossPoint], title: &str) -> Result<()> {
    let mut svg = String::new();
    render(&mut svg, path, points, title)?;
    write_atomic(path, svg.as_bytes())
}

/// The top of the learning-rate axis: the largest finite rate with headroom (1 without one).
fn lr_top(points: &[LossPoint]) -> f64 {
    let top = points
        .iter()
        .filter_map(|p| p.lr)
        .filter(|v| v.is_finite())
        .fold(0.0, f64::max);
    if top > 0.0 {
        top * 1.1
    } else {
        1.0
    }
}

/// One curve of the chart: `(step, f(point))` for each point where `f` has a finite value.
fn curve(points: &[LossPoint], f: &dyn Fn(&LossPoint) -> Option<f64>) -> Vec<(f64, f64)> {
    points
        .iter()
        .filter_map(|p| Some((p.step as f64, f(p)?)))
        .filter(|(_, v)| v.is_finite())
        .collect()
}

/// The chart of [`write_loss_chart`] as SVG text (`path` names it in errors).
fn render(svg: &mut String, path: &Path, points: &[LossPoint], title: &str) -> Result<()> {
    let err = |msg: String| Error::Chart {
        path: path.display().to_string(),
        msg,
    };
    let (first, last) = match (points.first(), points.last()) {
        (Some(a), Some(b)) => (a.step as f64, b.step as f64),
        _ => return Err(err("no step to draw".into())),
    };
    let (y0, y1) = span(points.iter().flat_map(|p| [Some(p.loss), p.val_loss]).flatten())
        .ok_or_else(|| err("no finite loss to draw".into()))?;
    let lr_top = lr_top(points);
    let root = SVGBackend::with_string(svg, (960, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let x = (first - 0.5)..(last + 0.5);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(20)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .right_y_label_area_size(80)
        .build_cartesian_2d(x.clone(), y0..y1)
        .map_err(|e| err(e.to_string()))?
        .set_secondary_coord(x, 0.0..lr_top);
    chart
        .configure_mesh()
        .x_desc("step")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_desc("loss")
        .draw()
        .map_err(|e| err(e.to_string()))?;
    chart
        .configure_secondary_axes()
        .y_desc("learning rate")
        .label_style(("sans-serif", 12))
        .y_label_formatter(&|v| format!("{v:.2e}"))
        .draw()
        .map_err(|e| err(e.to_string()))?;
    let curve = |f: &dyn Fn(&LossPoint) -> Option<f64>| curve(points, f);
    let legend =
        |color: RGBColor| move |(x, y): (i32, i32)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2));
    let train = curve(&|p: &LossPoint| Some(p.loss));
    let val = curve(&|p: &LossPoint| p.val_loss);
    for ((name, color), pts) in [(TRAIN, train), (VAL, val)] {
        if pts.is_empty() {
            continue;
        }
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(|e| err(e.to_string()))?
            .label(name)
            .legend(legend(color));
        if name == VAL.0 {
            // evaluated every N steps: each evaluation marked
            chart
                .draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))
                .map_err(|e| err(e.to_string()))?;
        }
    }
    let lrs = curve(&|p: &LossPoint| p.lr);
    if !lrs.is_empty() {
        let (name, color) = LR;
        chart
            .draw_secondary_series(LineSeries::new(lrs, color.stroke_width(2)))
            .map_err(|e| err(e.to_string()))?
            .label(name)
            .legend(legend(color));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()
        .map_err(|e| err(e.to_string()))?;
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_of_every_losses_format_are_read() {
        let p = LossPoint::from_csv_row("3,1.5,0.01,,0.9").unwrap();
        assert_eq!(
            p,
            LossPoint {
                step: 3,
                loss: 1.5,
                lr: Some(0.01),
                val_loss: Some(0.9)
            }
        );
        let p = LossPoint::from_csv_row("4,1.25").unwrap();
        assert_eq!(
            p,
            LossPoint {
                step: 4,
                loss: 1.25,
                lr: None,
                val_loss: None
            }
        );
        assert_eq!(LossPoint::from_csv_row("step,loss"), None);
    }

    #[test]
    fn a_diverged_step_is_left_out_and_nothing_finite_is_an_error() {
        let pts = |loss: f64| LossPoint {
            step: 0,
            loss,
            lr: Some(0.1),
            val_loss: None,
        };
        let mut svg = String::new();
        let e = render(&mut svg, Path::new("x.svg"), &[pts(f64::NAN)], "t").unwrap_err();
        assert!(e.to_string().contains("no finite loss"), "{e}");
        let mut svg = String::new();
        let two = [
            pts(1.0),
            LossPoint {
                step: 1,
                ..pts(f64::INFINITY)
            },
        ];
        render(&mut svg, Path::new("x.svg"), &two, "t").unwrap();
        assert!(!svg.contains("NaN"), "{svg}");
    }
}
