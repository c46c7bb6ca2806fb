//! Deferred initialisation: a model built inside `defer_param_init` holds no parameter bytes,
//! and any range its recipes draw is bit for bit that range of the model built whole.

use brigade_autograd::defer_param_init;
use brigade_models::{Gpt, GptConfig, Mlp, MlpConfig, Model};

fn whole_and_deferred(build: impl Fn() -> Box<dyn Model>) {
    let whole = build();
    let deferred = defer_param_init(&build);
    let (w, d) = (whole.params().params(), deferred.params().params());
    assert_eq!(w.len(), d.len());
    for (w, d) in w.iter().zip(d) {
        let name = w.name().unwrap();
        assert_eq!(d.value().storage_numel(), 0, "{name} holds no bytes");
        assert!(
            d.value().to_vec::<f32>().is_err(),
            "{name} reads as freed, never as zeros"
        );
        let init = d.deferred_init().expect("deferred");
        let values = w.value().to_vec::<f32>().unwrap();
        let n = values.len();
        // ranges that start and end anywhere, as a rank's shard does
        for (start, len) in [(0, n), (n / 3, n / 2), (n - 1, 1), (1, n - 1)] {
            let drawn = init.draw(start, len).unwrap().to_vec::<f32>().unwrap();
            assert_eq!(drawn, values[start..start + len], "{name} [{start}, +{len})");
        }
        d.materialize().unwrap();
        assert!(d.deferred_init().is_none());
        assert_eq!(d.value().to_vec::<f32>().unwrap(), values, "{name} materialised");
    }
}

#[test]
fn a_deferred_model_draws_any_range_of_each_parameter_as_the_whole_draw_does() {
    whole_and_deferred(|| {
        let cfg = GptConfig {
            d_model: 16,
            n_layers: 2,
            n_heads: 2,
            d_ff: 24,
            context: 8,
            ..GptConfig::default()
        };
        Box::new(Gpt::new(cfg, 5).unwrap())
    });
    whole_and_deferred(|| Box::new(Mlp::new(MlpConfig::new(vec![7, 9, 3]), 11).unwrap()));
}
