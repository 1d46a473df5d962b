//! Chat-template rendering: chat requests against SmolLM2's real template, and arbitrary
//! templates (size-capped) over a fixed conversation. Every render ends in `Ok` or `Err`:
//! no panic, no hang (fuel), no unbounded output.
#![no_main]

use engine::fuzzing::{check_chat_template, smollm2_tokenizer};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| check_chat_template(smollm2_tokenizer(), data));
