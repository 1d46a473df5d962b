//! HTTP request bodies of `/v1/chat/completions` and `/v1/completions` through the handlers'
//! own parsing, validation and prompt building (SmolLM2's chat template, a small tokenizer):
//! every body ends in prompt ids or a 4xx, never a panic or a 5xx.
#![no_main]

use engine::fuzzing::{check_request_body, smollm2_tokenizer};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| check_request_body(smollm2_tokenizer(), data));
