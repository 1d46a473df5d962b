//! Block files as the store reads them back: the in-memory decode (remote tier), the SSD
//! tier's pipelined file read (one read and small chunks), and the header-only parse
//! (`kvstore inspect`, GC) must agree, and none may panic.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    static SCRATCH: OnceLock<std::fs::File> = OnceLock::new();
    let scratch = SCRATCH.get_or_init(|| tempfile::tempfile().expect("a temporary file"));
    store::fuzzing::check_block_file(data, scratch);
});
