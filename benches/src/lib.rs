//! criterion benches live in benches/

#![warn(missing_docs)]
