//! Keys and namespace ids from text (file names, metadata, CLI arguments): parsing never
//! panics, accepts only 64 hex digits, and the canonical parse round-trips exactly.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| store::fuzzing::check_key_text(data));
