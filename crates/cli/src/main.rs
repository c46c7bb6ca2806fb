//! `brigade`: the command line with the built-in policies ([`brigade_cli::main_with`]).

fn main() -> std::process::ExitCode {
    brigade_cli::main_with(brigade::policies::Registry::new())
}
