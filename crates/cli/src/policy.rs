//! The policies the command line knows: the built-in ones and those of the [`Registry`] the
//! binary was started with ([`crate::main_with`]). `--policy` (and the hidden `--comm-hook`)
//! takes a spec as [`Registry::parse`] reads it, plus a bare name whose settings come from
//! flags of their own (`--powersgd-rank`, `--powersgd-start-iter`: [`settings_flags`]).

use std::sync::OnceLock;

use brigade::policies::{PolicySpec, Registry};

use crate::error::{Error, Result};

static REGISTRY: OnceLock<Registry> = OnceLock::new();

/// Makes `registry` the one the command line reads policies from (the first call wins).
pub fn install(registry: Registry) {
    let _ = REGISTRY.set(registry);
}

/// The registry the command line reads policies from: the installed one, else the built-in
/// policies alone.
pub fn registry() -> &'static Registry {
    REGISTRY.get_or_init(Registry::new)
}

/// The recipe that makes `spec`'s policy on each rank, user policies from [`registry`].
pub fn maker(spec: PolicySpec) -> std::sync::Arc<dyn brigade::policy::MakePolicy> {
    std::sync::Arc::new(brigade::policy::Registered {
        spec,
        registry: registry().clone(),
    })
}

/// `cmd` with every `--policy` flag's help listing the policies (`FORM: what it does`).
pub fn listed_in_help(cmd: clap::Command) -> clap::Command {
    let list = registry().help().join("; ");
    cmd.mut_subcommands(|sub| {
        if !sub.get_arguments().any(|a| a.get_id() == "policy") {
            return sub;
        }
        sub.mut_arg("policy", |a| {
            let help = a.get_help().map(|h| h.to_string()).unwrap_or_default();
            a.help(format!("{}. The policies: {list}.", help.trim_end_matches('.')))
        })
    })
}

/// Reads `entry` with the settings flags' values (a bare name with settings takes them).
pub fn resolve(entry: &str, powersgd_rank: usize, powersgd_start_iter: usize) -> Result<PolicySpec> {
    let usage = |e: brigade::policies::PolicyError| Error::Usage(format!("--policy {entry}: {e}"));
    let spec = PolicySpec::parse_with_settings(entry, powersgd_rank, powersgd_start_iter).map_err(usage)?;
    check_settings_agree(entry, &spec, [powersgd_rank, powersgd_start_iter])?;
    match &spec {
        // a user policy's name must be registered (a built-in one's settings are checked later)
        PolicySpec::User { .. } => registry().parse(&spec.to_string()).map_err(usage),
        _ => Ok(spec),
    }
}

/// Refuses a settings flag given beside an `entry` that names that setting otherwise
/// (`--powersgd-rank 3` with `powersgd:2`, `--powersgd-start-iter 0` with `powersgd:2@5`): the
/// entry's value would win without a word. `flags` holds the flags' values in the order of the
/// spec's [`PolicySpec::settings`]; a flag left at its default fills in what the entry leaves out.
fn check_settings_agree(entry: &str, spec: &PolicySpec, flags: [usize; 2]) -> Result<()> {
    let defaults = PolicySpec::parse_with_settings(entry, 0, 0).ok();
    let default_flags = brigade::policies::PowerSgdConfig::default();
    let default_flags = [default_flags.rank, default_flags.start_iter];
    let named = defaults.map(|d| d.settings()).unwrap_or_default();
    for (((name, value), (_, when_unnamed)), (flag, default)) in spec
        .settings()
        .into_iter()
        .zip(named)
        .zip(flags.into_iter().zip(default_flags))
    {
        // the entry names this setting when reading it with the flag at 0 does not give 0
        let entry_names_it = when_unnamed != 0 || value != flag;
        if entry_names_it && flag != default && flag != value {
            return Err(Error::Usage(format!(
                "{} {flag} with --policy {entry}, whose {} is {value}: give the setting in one place",
                crate::argv::flag_of(name),
                name.split_once('_')
                    .map_or(name, |(_, setting)| setting)
                    .replace('_', " "),
            )));
        }
    }
    Ok(())
}

/// Checks one `--policy` entry against the registry (clap's value parser; the message is the
/// rest of clap's line).
pub fn parse_entry(s: &str) -> std::result::Result<String, String> {
    let forms = registry().forms();
    if s.trim().is_empty() {
        return Err(format!("an empty entry names no policy: expected one of {forms}"));
    }
    match PolicySpec::parse_with_settings(s, 1, 0) {
        Ok(spec) => match registry().parse(&spec.to_string()) {
            Ok(_) => Ok(s.to_string()),
            Err(_) => Err(format!("unknown policy '{s}': expected one of {forms}")),
        },
        // a spec that names no policy lists the forms itself
        Err(e) if e.to_string().contains("the forms: ") => Err(e.to_string()),
        Err(e) => Err(format!("{e} (expected one of {forms})")),
    }
}

/// A policy's settings as the command line spells them: the flag of each setting name
/// (`powersgd_rank` is `--powersgd-rank`).
pub fn settings_flags(names: &[&str]) -> Vec<String> {
    names.iter().map(|n| crate::argv::flag_of(n)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_policy_specs() {
        for name in [
            "allreduce",
            "fp16",
            "bf16",
            "int8",
            "powersgd",
            "powersgd:4",
            "powersgd:4@2",
            "zero1",
            "zero2",
            "zero3",
        ] {
            assert_eq!(parse_entry(name).as_deref(), Ok(name));
        }
    }

    #[test]
    fn bad_entries_say_what_is_expected() {
        let e = parse_entry("foo").unwrap_err();
        assert!(e.contains("'foo'") && e.contains("powersgd:R"), "{e}");
        assert!(parse_entry("powersgd:0").unwrap_err().contains(">= 1"));
        assert!(parse_entry("powersgd:x").unwrap_err().contains("powersgd:R"));
        assert!(parse_entry("powersgd:2@x").unwrap_err().contains("start iteration"));
        assert!(parse_entry("zero4").unwrap_err().contains("unknown policy"));
        assert!(parse_entry("").is_err());
    }
}
