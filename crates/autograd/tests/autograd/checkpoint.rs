//! Activation checkpointing: a checkpointed scope gives the gradients of the plain graph bit
//! for bit, recomputes inside backward with its state restored, frees what its ops saved, and
//! announces each parameter once.

use std::sync::{Arc, Mutex};

use brigade_autograd::{
    checkpoint_scope, scope, AutogradError, GradReady, GradSubscriber, ParamStore, RecomputeState, SubscriberError, Var,
};
use brigade_tensor::{DType, Rng, Tensor};

/// A counter a unit draws a "mask" from: each forward call takes the next value.
#[derive(Clone, Default)]
struct Draws(Arc<Mutex<u64>>);

impl Draws {
    fn next(&self) -> u64 {
        let mut d = self.0.lock().unwrap();
        *d += 1;
        *d
    }
}

impl RecomputeState for Draws {
    type Saved = u64;
    fn save(&self) -> u64 {
        *self.0.lock().unwrap()
    }
    fn restore(&self, saved: &u64) {
        *self.0.lock().unwrap() = *saved;
    }
}

/// `x + relu(x W1^T + b1) W2^T * mask`: a residual unit whose mask comes from `draws`.
#[derive(Clone)]
struct Unit {
    w1: Var,
    b1: Var,
    w2: Var,
    draws: Draws,
}

impl Unit {
    fn forward(&self, x: &Var) -> brigade_autograd::Result<Var> {
        let h = x.linear(&self.w1, Some(&self.b1))?.relu()?;
        let mut rng = Rng::new(self.draws.next());
        let d = x.shape()[1];
        let mask = Tensor::randn(&[d], 1.0, DType::F32, &mut rng);
        x.add(&h.linear(&self.w2, None)?.mul(&Var::constant(mask))?)
    }
}

struct Model {
    store: ParamStore,
    units: Vec<Unit>,
    draws: Draws,
}

fn model(seed: u64) -> Model {
    let (mut store, mut rng, d, draws) = (ParamStore::new(), Rng::new(seed), 6, Draws::default());
    let units = (0..3)
        .map(|i| Unit {
            w1: store
                .add(format!("u{i}.w1"), Tensor::randn(&[8, d], 0.4, DType::F32, &mut rng))
                .unwrap(),
            b1: store
                .add(format!("u{i}.b1"), Tensor::randn(&[8], 0.1, DType::F32, &mut rng))
                .unwrap(),
            w2: store
                .add(format!("u{i}.w2"), Tensor::randn(&[d, 8], 0.4, DType::F32, &mut rng))
                .unwrap(),
            draws: draws.clone(),
        })
        .collect();
    Model { store, units, draws }
}

/// The loss with units `checkpointed` checkpointed.
fn loss(m: &Model, x: &Tensor, checkpointed: &[bool]) -> Var {
    let mut h = Var::constant(x.clone());
    for (i, u) in m.units.iter().enumerate() {
        let name = format!("u{i}");
        h = if checkpointed[i] {
            let u = u.clone();
            checkpoint_scope(&name, &h, m.draws.clone(), move |x: &Var| u.forward(x)).unwrap()
        } else {
            scope(&name, || u.forward(&h)).unwrap()
        };
    }
    h.mul(&h).unwrap().mean_all().unwrap()
}

fn grads(m: &Model) -> Vec<Vec<u32>> {
    m.store
        .params()
        .iter()
        .map(|p| {
            p.grad()
                .unwrap()
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        })
        .collect()
}

#[derive(Default)]
struct Ready(Mutex<Vec<String>>);

impl GradSubscriber for Ready {
    fn grad_ready(&self, ready: GradReady<'_>) -> Result<(), SubscriberError> {
        self.0.lock().unwrap().push(ready.name.to_string());
        Ok(())
    }
}

#[test]
fn checkpointed_units_give_the_plain_gradients_bit_for_bit_and_announce_each_parameter_once() {
    let x = Tensor::randn(&[5, 6], 1.0, DType::F32, &mut Rng::new(9));
    let plain = model(1);
    // two backward passes: the second adds into the first's gradients (accumulation)
    for _ in 0..2 {
        loss(&plain, &x, &[false; 3]).backward().unwrap();
    }
    for pattern in [[true, true, true], [true, false, true], [false, true, false]] {
        let ck = model(1);
        let log = Arc::new(Ready::default());
        ck.store.bus().subscribe(log.clone());
        for _ in 0..2 {
            loss(&ck, &x, &pattern).backward().unwrap();
        }
        assert_eq!(grads(&ck), grads(&plain), "pattern {pattern:?}");
        // the draws continue where the plain run's do: the recompute put the state back
        assert_eq!(ck.draws.save(), plain.draws.save(), "pattern {pattern:?}");
        let mut names = log.0.lock().unwrap().clone();
        assert_eq!(names.len(), 2 * 9, "each parameter once per pass: {names:?}");
        names.sort();
        names.dedup();
        assert_eq!(names.len(), 9);
    }
}

#[test]
fn a_recompute_that_draws_elsewhere_changes_the_gradients() {
    // the same units with a state that is not restored: the recompute draws the next mask
    struct Forgetful;
    impl RecomputeState for Forgetful {
        type Saved = ();
        fn save(&self) {}
        fn restore(&self, _: &()) {}
    }
    let x = Tensor::randn(&[5, 6], 1.0, DType::F32, &mut Rng::new(9));
    let plain = model(1);
    loss(&plain, &x, &[false; 3]).backward().unwrap();
    let ck = model(1);
    let mut h = Var::constant(x.clone());
    for (i, u) in ck.units.iter().enumerate() {
        let u = u.clone();
        h = checkpoint_scope(&format!("u{i}"), &h, Forgetful, move |x: &Var| u.forward(x)).unwrap();
    }
    h.mul(&h).unwrap().mean_all().unwrap().backward().unwrap();
    assert_ne!(grads(&ck), grads(&plain));
}

#[test]
fn a_checkpointed_unit_keeps_only_its_input_and_its_output() {
    // the unit's hidden activations are freed after its forward: a tensor saved by an op
    // inside it is viewed by nobody but the graph, which was dropped
    let m = model(1);
    let x = Var::constant(Tensor::randn(&[5, 6], 1.0, DType::F32, &mut Rng::new(9)));
    let seen: Arc<Mutex<Option<Tensor>>> = Arc::default();
    let (u, keep) = (m.units[0].clone(), seen.clone());
    let y = checkpoint_scope("u0", &x, (), move |x: &Var| {
        let h = x.linear(&u.w1, Some(&u.b1))?;
        keep.lock().unwrap().get_or_insert(h.value());
        h.relu()?.linear(&u.w2, None)
    })
    .unwrap();
    let hidden = seen.lock().unwrap().take().unwrap();
    assert!(
        hidden.is_sole_owner(),
        "the unit's graph still holds its hidden activation"
    );
    y.sum_all().unwrap().backward().unwrap();
    assert!(m.units[0].w1.grad().is_some() && m.units[0].w2.grad().is_some());
}

#[test]
fn a_unit_reading_an_outer_intermediate_is_one_error_naming_the_op() {
    let m = model(1);
    let x = Var::constant(Tensor::randn(&[5, 6], 1.0, DType::F32, &mut Rng::new(9)));
    let outer = x.linear(&m.units[0].w1, None).unwrap();
    let w2 = m.units[0].w2.clone();
    let o = outer.clone();
    let e = checkpoint_scope("u1", &x, (), move |_x: &Var| o.relu()?.linear(&w2, None)).unwrap_err();
    assert!(
        matches!(e, AutogradError::CheckpointInput { op, .. } if op == "linear"),
        "{e}"
    );
    assert!(e.to_string().contains("'u1'"), "{e}");
}
