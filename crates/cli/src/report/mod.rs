//! What the command line draws and tabulates from a run: the timeline's SVG Gantt chart and
//! the sweep's statistics.

pub mod sweep_stats;
pub mod timeline_svg;
