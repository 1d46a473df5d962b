//! Integration tests of the store: one binary, one module per area.

mod block_buffers;
mod chains;
mod common;
mod corruption;
mod crash;
mod enospc;
mod eviction;
mod facade;
mod faults;
mod fixtures;
mod fuzz_corpus;
mod gc_inspect;
mod locking;
mod pins;
mod planted_links;
#[path = "../../../tests/src/prerequisite.rs"]
mod prerequisite;
mod props;
mod redis_server;
mod remote;
mod security;
mod tier_contract;
mod vectors;
