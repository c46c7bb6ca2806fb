//! Scope hooks: told when the forward enters and leaves each scope, with its full path, on the
//! thread they are installed on only; and parameters' units.

use std::sync::{Arc, Mutex};

use brigade_autograd::{scope, set_scope_hooks, ParamStore, ScopeHooks};
use brigade_tensor::{DType, Tensor};

#[derive(Default)]
struct Log(Mutex<Vec<String>>);

impl ScopeHooks for Log {
    fn enter(&self, scope: &str) {
        self.0.lock().unwrap().push(format!("enter {scope}"));
    }
    fn exit(&self, scope: &str) {
        self.0.lock().unwrap().push(format!("exit {scope}"));
    }
}

#[test]
fn hooks_see_every_scope_entered_and_left_in_order_on_their_thread() {
    let log = Arc::new(Log::default());
    assert!(set_scope_hooks(Some(log.clone())).is_none());
    let inside = scope("blocks.0", || scope("attn", || 1) + 1);
    assert_eq!(inside, 2);
    // another thread has no hooks
    std::thread::spawn(|| scope("elsewhere", || ())).join().unwrap();
    let removed = set_scope_hooks(None).expect("installed");
    scope("after", || ());
    drop(removed);
    assert_eq!(
        *log.0.lock().unwrap(),
        [
            "enter blocks.0",
            "enter blocks.0.attn",
            "exit blocks.0.attn",
            "exit blocks.0"
        ]
    );
}

#[test]
fn a_parameter_has_the_unit_it_was_given() {
    let mut store = ParamStore::new();
    store.add("a.w", Tensor::zeros(&[2], DType::F32)).unwrap();
    store.add("b.w", Tensor::zeros(&[2], DType::F32)).unwrap();
    store.set_unit("b.w", "blocks.1").unwrap();
    assert_eq!((store.unit(0), store.unit(1)), (None, Some("blocks.1")));
    assert!(store
        .set_unit("c.w", "x")
        .unwrap_err()
        .to_string()
        .contains("no parameter 'c.w'"));
    assert!(store.set_unit("a.w", "").is_err());
}
