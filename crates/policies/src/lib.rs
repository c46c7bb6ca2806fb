//! brigade-policies: Brigade's built-in reducer policies.

#![warn(missing_docs)]
