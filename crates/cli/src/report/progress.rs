//! The progress bar of `brigade train` (stderr): one observer of the run
//! ([`brigade::observe::TrainObserver`]), drawn from rank 0's step records and cleared at the
//! run's end.

use std::sync::Mutex;

use brigade::observe::{RunStart, TrainObserver};
use brigade::outcome::StepRecord;
use brigade::outcome::TrainOutcome;
use indicatif::ProgressStyle;

/// The bar, once the run started.
#[derive(Default)]
pub struct ProgressBar {
    bar: Mutex<Option<indicatif::ProgressBar>>,
}

impl ProgressBar {
    fn with_bar(&self, f: impl FnOnce(&mut Option<indicatif::ProgressBar>)) {
        // a poisoned lock only means an earlier draw panicked: drawing is best effort
        if let Ok(mut bar) = self.bar.lock() {
            f(&mut bar);
        }
    }
}

impl TrainObserver for ProgressBar {
    fn run_started(&self, start: &RunStart) {
        let bar = indicatif::ProgressBar::new(start.steps.saturating_sub(start.first_step) as u64);
        bar.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} steps | {msg} | eta {eta}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        self.with_bar(|b| *b = Some(bar));
    }

    fn step_finished(&self, r: &StepRecord) {
        self.with_bar(|b| {
            if let Some(bar) = b {
                bar.set_message(format!("step {} loss {:.4} | {:.1} ms/step", r.step, r.loss, r.ms));
                bar.inc(1);
            }
        });
    }

    fn run_finished(&self, _outcome: Result<&TrainOutcome, &brigade::Error>) {
        self.with_bar(|b| {
            if let Some(bar) = b.take() {
                bar.finish_and_clear();
            }
        });
    }
}
