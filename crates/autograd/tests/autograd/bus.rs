//! The gradient-ready bus: order and timing of announcements, gradient buffers,
//! accumulation across backward passes, no_grad.

use std::sync::{Arc, Mutex};

use brigade_autograd::{no_grad, scope, AutogradError, GradReady, GradSubscriber, ParamStore, SubscriberError, Var};
use brigade_tensor::{DType, Rng, Tensor};

#[derive(Debug, Clone, PartialEq)]
enum Event {
    Node(String),
    Ready(String),
}

#[derive(Default)]
struct Log(Mutex<Vec<Event>>);

impl GradSubscriber for Log {
    fn node_backward(&self, scope: Option<&str>, _op: &str) {
        self.0
            .lock()
            .unwrap()
            .push(Event::Node(scope.unwrap_or("").to_string()));
    }
    fn grad_ready(&self, ready: GradReady<'_>) -> Result<(), SubscriberError> {
        self.0.lock().unwrap().push(Event::Ready(ready.name.to_string()));
        Ok(())
    }
}

/// A 4-layer MLP, each layer recorded under scope `layers.{i}`.
fn mlp(store: &mut ParamStore, widths: &[usize], rng: &mut Rng) -> Vec<(Var, Var)> {
    widths
        .windows(2)
        .enumerate()
        .map(|(i, w)| {
            let weight = store
                .add(
                    format!("layers.{i}.weight"),
                    Tensor::randn(&[w[1], w[0]], 0.3, DType::F32, rng),
                )
                .unwrap();
            let bias = store
                .add(format!("layers.{i}.bias"), Tensor::randn(&[w[1]], 0.1, DType::F32, rng))
                .unwrap();
            (weight, bias)
        })
        .collect()
}

fn forward(layers: &[(Var, Var)], x: &Var) -> Var {
    let mut h = x.clone();
    for (i, (w, b)) in layers.iter().enumerate() {
        h = scope(&format!("layers.{i}"), || {
            let y = h.linear(w, Some(b))?;
            if i + 1 < layers.len() {
                y.relu()
            } else {
                Ok(y)
            }
        })
        .unwrap();
    }
    h
}

#[test]
fn last_layer_is_announced_first_and_before_earlier_layers_run_backward() {
    let mut rng = Rng::new(7);
    let mut store = ParamStore::new();
    let layers = mlp(&mut store, &[6, 8, 8, 8, 3], &mut rng);
    let log = Arc::new(Log::default());
    store.bus().subscribe(log.clone());
    let x = Var::constant(Tensor::randn(&[5, 6], 1.0, DType::F32, &mut rng));
    let targets = Tensor::from_vec(vec![0i64, 1, 2, 1, 0], &[5]).unwrap();
    forward(&layers, &x)
        .cross_entropy(&targets)
        .unwrap()
        .backward()
        .unwrap();
    let events = log.0.lock().unwrap().clone();

    let ready: Vec<&str> = events
        .iter()
        .filter_map(|e| {
            if let Event::Ready(n) = e {
                Some(n.as_str())
            } else {
                None
            }
        })
        .collect();
    assert_eq!(ready.len(), 8, "every parameter announced exactly once: {ready:?}");
    assert!(
        ready[..2].iter().all(|n| n.starts_with("layers.3.")),
        "last layer first: {ready:?}"
    );
    let layer_of = |n: &str| n.split('.').nth(1).unwrap().parse::<usize>().unwrap();
    let order: Vec<usize> = ready.iter().map(|n| layer_of(n)).collect();
    assert!(
        order.windows(2).all(|w| w[0] >= w[1]),
        "announced in reverse layer order: {ready:?}"
    );

    // Each layer's parameters are announced before any backward node of an earlier layer runs.
    for i in 1..4 {
        let last_ready = events
            .iter()
            .rposition(|e| matches!(e, Event::Ready(n) if layer_of(n) == i))
            .unwrap();
        let first_earlier = events
            .iter()
            .position(|e| matches!(e, Event::Node(s) if s.starts_with("layers.") && layer_of(s) < i))
            .unwrap();
        assert!(
            last_ready < first_earlier,
            "layer {i} announced at {last_ready}, earlier layer backward at {first_earlier}: {events:?}"
        );
    }
}

#[test]
fn a_parameter_used_twice_is_announced_once_after_both_contributions() {
    let mut store = ParamStore::new();
    let w = store.add("w", Tensor::from_vec(vec![3.0f64], &[1]).unwrap()).unwrap();
    let log = Arc::new(Log::default());
    store.bus().subscribe(log.clone());
    // y = w*w + w  => dy/dw = 2w + 1 = 7
    let y = w.mul(&w).unwrap().add(&w).unwrap().sum_all().unwrap();
    y.backward().unwrap();
    assert_eq!(w.grad().unwrap().to_vec::<f64>().unwrap(), vec![7.0]);
    let ready = log
        .0
        .lock()
        .unwrap()
        .iter()
        .filter(|e| matches!(e, Event::Ready(_)))
        .count();
    assert_eq!(ready, 1);
}

#[test]
fn gradients_accumulate_into_an_attached_buffer_until_zeroed() {
    let mut store = ParamStore::new();
    let w = store
        .add("w", Tensor::from_vec(vec![1.0f64, 2.0], &[2]).unwrap())
        .unwrap();
    let flat = Tensor::zeros(&[5], DType::F64);
    w.set_grad_buffer(flat.flat_view(3, &[2]).unwrap()).unwrap();
    // y = sum(w * [10, 20]) => dy/dw = [10, 20]
    let c = Var::constant(Tensor::from_vec(vec![10.0f64, 20.0], &[2]).unwrap());
    for _ in 0..2 {
        w.mul(&c).unwrap().sum_all().unwrap().backward().unwrap();
    }
    assert_eq!(flat.to_vec::<f64>().unwrap(), vec![0.0, 0.0, 0.0, 20.0, 40.0]);
    store.zero_grad().unwrap();
    assert_eq!(flat.to_vec::<f64>().unwrap(), vec![0.0; 5]);
    assert!(w.grad().unwrap().shares_storage(&flat), "zeroing keeps the buffer");
    assert!(
        w.set_grad_buffer(Tensor::zeros(&[3], DType::F64)).is_err(),
        "a buffer of the wrong shape is refused"
    );
}

#[test]
fn no_grad_records_nothing() {
    let mut store = ParamStore::new();
    let w = store.add("w", Tensor::ones(&[2], DType::F32)).unwrap();
    let y = no_grad(|| w.exp().unwrap().sum_all().unwrap());
    assert!(!y.requires_grad());
    assert!(y.backward().is_err());
}

#[test]
fn a_failing_subscriber_aborts_backward_with_its_message() {
    struct Refuse;
    impl GradSubscriber for Refuse {
        fn grad_ready(&self, r: GradReady<'_>) -> Result<(), SubscriberError> {
            Err(format!("cannot take {}", r.name).into())
        }
    }
    let mut store = ParamStore::new();
    let w = store.add("w", Tensor::ones(&[2], DType::F32)).unwrap();
    store.bus().subscribe(Arc::new(Refuse));
    let err = w.exp().unwrap().sum_all().unwrap().backward().unwrap_err().to_string();
    assert!(err.contains("cannot take w"), "{err}");
}

/// A subscriber's own error type, with a cause of its own.
#[derive(Debug)]
struct Refused {
    param: String,
    cause: std::io::Error,
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "refused {}", self.param)
    }
}

impl std::error::Error for Refused {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.cause)
    }
}

#[test]
fn a_subscriber_error_crosses_the_bus_typed_with_its_source_chain() {
    struct Typed;
    impl GradSubscriber for Typed {
        fn grad_ready(&self, r: GradReady<'_>) -> Result<(), SubscriberError> {
            Err(Box::new(Refused {
                param: r.name.to_string(),
                cause: std::io::Error::other("link down"),
            }))
        }
    }
    let mut store = ParamStore::new();
    let w = store.add("w", Tensor::ones(&[2], DType::F32)).unwrap();
    store.bus().subscribe(Arc::new(Typed));
    let err = w.exp().unwrap().sum_all().unwrap().backward().unwrap_err();
    assert!(
        matches!(&err, AutogradError::Subscriber { param, .. } if param == "parameter 'w'"),
        "{err}"
    );
    let source = std::error::Error::source(&err).expect("the subscriber's error is the source");
    let refused = source
        .downcast_ref::<Refused>()
        .expect("downcasts to the subscriber's type");
    assert_eq!(refused.param, "w");
    let cause = source
        .source()
        .expect("its own source is kept")
        .downcast_ref::<std::io::Error>()
        .unwrap();
    assert_eq!(cause.to_string(), "link down");
}

#[test]
fn a_frozen_parameter_gets_no_gradient_and_is_not_announced() {
    let mut store = ParamStore::new();
    let w = store
        .add("w", Tensor::from_vec(vec![1.0f64, 2.0], &[2]).unwrap())
        .unwrap();
    let frozen = store
        .add("frozen", Tensor::from_vec(vec![3.0f64, 4.0], &[2]).unwrap())
        .unwrap();
    let log = Arc::new(Log::default());
    store.bus().subscribe(log.clone());
    let loss = |w: &Var, f: &Var| w.mul(f).unwrap().sum_all().unwrap();
    // a gradient from before the freeze is discarded by it (PyTorch users set p.grad = None)
    loss(&w, &frozen).backward().unwrap();
    assert!(frozen.grad().is_some());
    frozen.set_requires_grad(false).unwrap();
    assert!(!frozen.requires_grad() && frozen.grad().is_none());
    log.0.lock().unwrap().clear();
    store.zero_grad().unwrap();
    // y = sum(w * f)  =>  dy/dw = f = [3, 4]; nothing for f
    loss(&w, &frozen).backward().unwrap();
    assert_eq!(w.grad().unwrap().to_vec::<f64>().unwrap(), vec![3.0, 4.0]);
    assert!(frozen.grad().is_none(), "a frozen parameter accumulates no gradient");
    let ready: Vec<Event> = log
        .0
        .lock()
        .unwrap()
        .iter()
        .filter(|e| matches!(e, Event::Ready(_)))
        .cloned()
        .collect();
    assert_eq!(ready, [Event::Ready("w".into())]);
    // a loss of frozen parameters only has no graph
    assert!(matches!(
        frozen.exp().unwrap().sum_all().unwrap().backward(),
        Err(AutogradError::NoGraph)
    ));
    // unfreezing: gradients flow again
    frozen.set_requires_grad(true).unwrap();
    loss(&w, &frozen).backward().unwrap();
    assert_eq!(frozen.grad().unwrap().to_vec::<f64>().unwrap(), vec![1.0, 2.0]);
    // only leaves can be frozen
    let y = w.exp().unwrap();
    assert!(matches!(
        y.set_requires_grad(false),
        Err(AutogradError::NotALeaf { op: "exp" })
    ));
}
