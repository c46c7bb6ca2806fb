//! Dynamic loss scaling for fp16 (PyTorch's `torch.amp.GradScaler`): the loss is multiplied by
//! the scale before backward so that small fp16 gradients do not flush to zero; the gradients
//! are divided by it again in f32 before clipping and the step; a step whose gradients hold an
//! inf or a NaN is skipped and the scale halved; after `growth_interval` clean steps in a row
//! the scale doubles.

use brigade_tensor::{DType, Tensor};

use crate::{AutogradError, Result};

/// The scale a run starts with (PyTorch's `init_scale`, 2^16).
pub const INIT_SCALE: f64 = 65536.0;

/// Clean steps in a row after which the scale doubles (PyTorch's `growth_interval`).
pub const GROWTH_INTERVAL: u64 = 2000;

/// The loss scale and its counter of clean steps, updated once per step from whether that
/// step's gradients were finite (on every rank alike: the caller passes the verdict all ranks
/// share).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradScaler {
    scale: f64,
    growth_tracker: u64,
    growth_interval: u64,
    skipped: u64,
}

impl GradScaler {
    /// Starts at [`INIT_SCALE`], doubling after `growth_interval` (>= 1) clean steps in a row.
    pub fn new(growth_interval: u64) -> GradScaler {
        GradScaler {
            scale: INIT_SCALE,
            growth_tracker: 0,
            growth_interval: growth_interval.max(1),
            skipped: 0,
        }
    }

    /// The factor the loss is multiplied by before backward.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Clean steps in a row since the scale last changed.
    pub fn growth_tracker(&self) -> u64 {
        self.growth_tracker
    }

    /// Steps skipped so far by this scaler (not saved: a resumed run counts its own).
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// Records one step: `found_inf` (an inf or NaN in any gradient on any rank) halves the
    /// scale and returns `false` (skip the step); else counts a clean step, doubles the scale
    /// after the interval, and returns `true`. A scale backed off below 1 is an error: the
    /// gradients are not finite even unscaled.
    pub fn update(&mut self, found_inf: bool) -> Result<bool> {
        if found_inf {
            self.scale *= 0.5;
            self.growth_tracker = 0;
            self.skipped += 1;
            if self.scale < 1.0 {
                return Err(AutogradError::Invalid(format!(
                    "fp16 loss scale backed off to {} (< 1): the gradients are not finite even unscaled; lower the learning rate or train in bf16",
                    self.scale
                )));
            }
            return Ok(false);
        }
        self.growth_tracker += 1;
        if self.growth_tracker >= self.growth_interval {
            self.scale *= 2.0;
            self.growth_tracker = 0;
        }
        Ok(true)
    }

    /// The scale and its counter as checkpoint entries (`grad_scaler.scale`,
    /// `grad_scaler.growth_tracker`, one-element f64 tensors).
    pub fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        let one = |v: f64| Tensor::from_vec(vec![v], &[1]);
        Ok(vec![
            ("grad_scaler.scale".into(), one(self.scale)?),
            ("grad_scaler.growth_tracker".into(), one(self.growth_tracker as f64)?),
        ])
    }

    /// Takes the scaler's entries out of `state` (as [`GradScaler::state_dict`] wrote them),
    /// returning the others; a state without them leaves the scaler as it is.
    pub fn load_from(&mut self, state: &[(String, Tensor)]) -> Result<Vec<(String, Tensor)>> {
        let mut rest = vec![];
        for (k, t) in state {
            let v = || -> Result<f64> { Ok(t.to_dtype(DType::F64)?.item()?) };
            match k.as_str() {
                "grad_scaler.scale" => self.scale = v()?,
                "grad_scaler.growth_tracker" => self.growth_tracker = v()? as u64,
                _ => rest.push((k.clone(), t.clone())),
            }
        }
        Ok(rest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skip_backoff_and_growth_follow_the_hand_computed_sequence() {
        // interval 3; verdicts: clean, inf, clean x3, clean x3, inf, inf
        //   clean : 65536, tracker 1, step
        //   inf   : 32768, tracker 0, skip
        //   clean x3: tracker 1, 2, then 3 = interval -> 65536, tracker 0
        //   clean x3: -> 131072
        //   inf, inf: 65536, 32768, both skipped
        let mut s = GradScaler::new(3);
        let verdicts = [false, true, false, false, false, false, false, false, true, true];
        let mut got = vec![];
        for inf in verdicts {
            let step = s.update(inf).unwrap();
            got.push((step, s.scale(), s.growth_tracker()));
        }
        let want = vec![
            (true, 65536.0, 1),
            (false, 32768.0, 0),
            (true, 32768.0, 1),
            (true, 32768.0, 2),
            (true, 65536.0, 0),
            (true, 65536.0, 1),
            (true, 65536.0, 2),
            (true, 131072.0, 0),
            (false, 65536.0, 0),
            (false, 32768.0, 0),
        ];
        assert_eq!(got, want);
        assert_eq!(s.skipped(), 3);
    }

    #[test]
    fn a_scale_below_one_stops_in_one_line_and_the_state_round_trips() {
        let mut s = GradScaler::new(GROWTH_INTERVAL);
        // 2^16 halves to 1 after 16 skips; the 17th goes below 1
        for _ in 0..16 {
            assert!(!s.update(true).unwrap());
        }
        assert_eq!(s.scale(), 1.0);
        let e = s.update(true).unwrap_err().to_string();
        assert!(
            e.contains("loss scale") && e.contains("< 1") && !e.contains('\n'),
            "{e}"
        );

        let mut a = GradScaler::new(5);
        a.update(true).unwrap();
        a.update(false).unwrap();
        let mut state = a.state_dict().unwrap();
        state.push(("exp_avg.w".into(), Tensor::zeros(&[2], DType::F32)));
        let mut b = GradScaler::new(5);
        let rest = b.load_from(&state).unwrap();
        assert_eq!((b.scale(), b.growth_tracker()), (32768.0, 1));
        assert_eq!(rest.len(), 1);
    }
}
