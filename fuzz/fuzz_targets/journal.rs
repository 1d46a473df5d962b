//! The access journal from arbitrary bytes: replay never panics, keeps exactly the valid
//! prefix, and an undamaged journal is byte for byte what the writer would write.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| store::fuzzing::check_journal(data));
