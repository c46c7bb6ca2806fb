//! One module per subcommand: `train`, `sweep` (bucket caps; `policy_sweep` for `--policy`; their
//! flags in `sweep_args`), `predict`, `plan`, `sample`, `tokenize` and `bench`.

pub mod bench;
pub mod plan;
pub mod policy_sweep;
pub mod predict;
pub mod sample;
pub mod study;
pub mod sweep;
pub mod sweep_args;
pub mod tokenize;
pub mod train;
