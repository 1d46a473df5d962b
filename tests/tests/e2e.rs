//! End-to-end tests across crates: one test binary, one module per area.

mod anthropic_client;
mod bitflips;
mod cli_reuse;
mod faults;
mod linking;
mod one_loop;
mod openai_client;
mod remote;
mod reuse;
