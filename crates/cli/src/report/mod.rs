//! What the command line draws, prints and tabulates from a run: the progress bar and the
//! summary (observers of the run), the timeline's SVG Gantt chart, the loss chart of `--plot`
//! and the sweep's statistics.

pub mod loss_chart;
pub mod progress;
pub mod stdout;
pub mod summary;
pub mod sweep_stats;
pub mod timeline_svg;
