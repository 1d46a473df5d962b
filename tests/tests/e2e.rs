//! End-to-end tests across crates: one test binary, one module per area.

mod linking;
mod reuse;
