//! The whole `brigade` command line with a policy of your own added: register it by name and
//! hand the registry to [`brigade_cli::main_with`]. Then
//!
//! ```text
//! cargo run -p brigade-cli --example own_policy -- train --world-size 2 --policy mean:2
//! ```
//!
//! trains under it, and `--help` lists it beside the built-in policies.
//!
//! The policy here averages each bucket with one all-reduce, as the built-in `allreduce` does,
//! under its own name; its argument (`mean:N`) is a number it checks, to show where a policy's
//! settings arrive.

use brigade::ddp::policy::{Group, PolicyBucket, ReducerPolicy, Reduction, WireModel};
use brigade::policies::{AllReduce, PolicyError, Registry};

/// An averaging all-reduce named `mean`.
struct Mean {
    every: u32,
}

impl ReducerPolicy for Mean {
    fn name(&self) -> String {
        format!("mean:{}", self.every)
    }

    fn keeps_state(&self) -> brigade::ddp::KeepsState {
        brigade::ddp::KeepsState::Nothing
    }

    fn reduce(&mut self, bucket: PolicyBucket, comm: &Group) -> brigade::ddp::Result<Reduction> {
        AllReduce.reduce(bucket, comm)
    }

    fn wire_model(&self, shapes: &[Vec<usize>], world_size: usize) -> Option<WireModel> {
        AllReduce.wire_model(shapes, world_size)
    }
}

/// The built-in policies and `mean[:N]`.
pub fn policies() -> Registry {
    let mut registry = Registry::new();
    registry
        .register_about("mean", "an averaging all-reduce, of your own", |arg| {
            let every = arg
                .unwrap_or("1")
                .parse()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| PolicyError::Config {
                    policy: "mean".into(),
                    reason: format!("N must be a whole number >= 1, got '{}'", arg.unwrap_or_default()),
                })?;
            Ok(Box::new(Mean { every }))
        })
        .expect("a free name");
    registry
}

#[allow(dead_code)] // a test includes this file for `policies`
fn main() -> std::process::ExitCode {
    brigade_cli::main_with(policies())
}
