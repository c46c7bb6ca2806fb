//! The policies crate's error type.

use brigade_ddp::DdpError;

/// What can go wrong naming, configuring or building a policy.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// A policy spec that does not parse.
    #[error("invalid policy '{spec}': {reason}")]
    Spec {
        /// The spec as given.
        spec: String,
        /// What is wrong, and the forms that parse.
        reason: String,
    },
    /// A policy's settings that cannot work.
    #[error("{policy}: {reason}")]
    Config {
        /// The policy (`powersgd`).
        policy: String,
        /// What is wrong and what to change.
        reason: String,
    },
    /// A user policy's name that no one registered.
    #[error("unknown policy '{name}': built in are {built_in}{registered}")]
    Unknown {
        /// The name.
        name: String,
        /// The built-in forms, listed.
        built_in: String,
        /// `; registered: a, b` (or nothing).
        registered: String,
    },
    /// A name registered twice, or a built-in name taken.
    #[error("policy name '{0}' is taken (built-in names and registered ones are unique)")]
    Taken(String),
    /// DDP refused or failed.
    #[error(transparent)]
    Ddp(#[from] DdpError),
}

impl From<PolicyError> for DdpError {
    fn from(e: PolicyError) -> DdpError {
        match e {
            PolicyError::Ddp(d) => d,
            other => DdpError::Policy {
                policy: "spec".into(),
                reason: other.to_string(),
            },
        }
    }
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, PolicyError>;
