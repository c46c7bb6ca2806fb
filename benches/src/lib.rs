//! criterion benches live in benches/
