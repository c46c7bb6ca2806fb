//! Where the command line meets the library's configuration: the flag of each configuration
//! field ([`flag_of`]), and a plan's configuration as the arguments of `brigade train`.

/// The flag that sets configuration field `field` (`reduce_dtype` is `--reduce-dtype`; a
/// field path `mixed.reduce_dtype` names its last part).
pub fn flag_of(field: &str) -> String {
    let last = field.rsplit('.').next().unwrap_or(field);
    format!("--{}", last.replace('_', "-"))
}
