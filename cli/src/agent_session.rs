//! A scripted multi-turn agent session, the workload kvstore is built for: a system prompt
//! with tool definitions, a task, then turns of assistant tool calls and tool results, each
//! request resending the whole, growing conversation. Deterministic, so every run and every
//! benchmark arm replays the same transcript.

use serde_json::{json, Value};

/// The tool definitions (OpenAI function schemas) the agent is given.
pub fn tools() -> Value {
    let tool = |name: &str, description: &str, params: Value| json!({"type": "function", "function": {"name": name, "description": description, "parameters": params}});
    let path = json!({"type": "object", "properties": {"path": {"type": "string", "description": "Path relative to the repository root"}}, "required": ["path"]});
    json!([
        tool(
            "list_files",
            "List the files under a directory of the repository.",
            path.clone()
        ),
        tool(
            "read_file",
            "Read a file of the repository and return its text.",
            path
        ),
        tool(
            "run_tests",
            "Run the test suite (optionally one test) and return its output.",
            json!({"type": "object", "properties": {"filter": {"type": "string"}}})
        ),
        tool(
            "edit_file",
            "Replace one exact snippet of a file with new text.",
            json!({"type": "object", "properties": {"path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}}, "required": ["path", "old", "new"]})
        ),
    ])
}

fn system_prompt() -> String {
    let tools = serde_json::to_string_pretty(&tools()).unwrap_or_default();
    format!(
        "You are a careful coding agent working in a Rust repository. Use the tools to look \
         around before you change anything, make the smallest fix, and run the tests after \
         every edit. Call a tool by answering with a single line \
         <tool_call>{{\"name\": ..., \"arguments\": {{...}}}}</tool_call>. Tools:\n{tools}"
    )
}

/// A Rust source file of `functions` small parsers: what `read_file` returns.
fn source_file(module: &str, functions: usize, seed: usize) -> String {
    let mut s = format!(
        "//! {module}: parsing of configuration values.\n\nuse crate::error::ParseError;\n\n"
    );
    for i in 0..functions {
        let n = (seed * 7 + i * 13) % 97;
        s.push_str(&format!(
            "/// Parses field {i} of a `{module}` record (at most {n} characters).\n\
             pub fn parse_{module}_{i}(input: &str) -> Result<u32, ParseError> {{\n    \
             let trimmed = input.trim();\n    \
             if trimmed.len() > {n} {{\n        \
             return Err(ParseError::TooLong {{ field: \"{module}_{i}\", max: {n} }});\n    }}\n    \
             trimmed.parse::<u32>().map_err(|e| ParseError::Number {{ field: \"{module}_{i}\", source: e }})\n}}\n\n"
        ));
    }
    s
}

fn test_output(failing: bool, turn: usize) -> String {
    let mut s = String::from("   Compiling config v0.3.1 (/repo)\n    Finished test profile in 2.41s\n     Running unittests src/lib.rs\n\nrunning 12 tests\n");
    for i in 0..12 {
        let ok = !(failing && i == 7);
        s.push_str(&format!(
            "test tests::parse_case_{i:02} ... {}\n",
            if ok { "ok" } else { "FAILED" }
        ));
    }
    if failing {
        s.push_str(&format!(
            "\nfailures:\n\n---- tests::parse_case_07 stdout ----\nthread 'tests::parse_case_07' panicked at src/duration.rs:{}:9:\n\
             assertion `left == right` failed\n  left: Err(TooLong {{ field: \"duration_3\", max: 12 }})\n right: Ok(90)\n\n\
             test result: FAILED. 11 passed; 1 failed; 0 ignored\n",
            40 + turn
        ));
    } else {
        s.push_str("\ntest result: ok. 12 passed; 0 failed; 0 ignored\n");
    }
    s
}

/// One scripted step: the assistant's tool call and the tool's result.
fn step(i: usize) -> (String, String) {
    let call = |name: &str, args: Value| {
        format!(
            "<tool_call>{}</tool_call>",
            json!({"name": name, "arguments": args})
        )
    };
    match i {
        0 => (
            call("list_files", json!({"path": "src"})),
            "src/lib.rs\nsrc/error.rs\nsrc/duration.rs\nsrc/size.rs\nsrc/record.rs\nsrc/tests.rs\n"
                .into(),
        ),
        1 => (call("run_tests", json!({})), test_output(true, i)),
        2 => (
            call("read_file", json!({"path": "src/duration.rs"})),
            source_file("duration", 3, i),
        ),
        3 => (
            call("read_file", json!({"path": "src/error.rs"})),
            source_file("error", 2, i),
        ),
        4 => (
            call("read_file", json!({"path": "src/record.rs"})),
            source_file("record", 3, i),
        ),
        5 => (
            call("read_file", json!({"path": "src/tests.rs"})),
            source_file("tests", 3, i),
        ),
        6 => (
            call(
                "edit_file",
                json!({"path": "src/duration.rs", "old": "if trimmed.len() > 12 {", "new": "if trimmed.len() > 24 {"}),
            ),
            "Edited src/duration.rs: 1 replacement.".into(),
        ),
        7 => (
            call("run_tests", json!({"filter": "parse_case_07"})),
            test_output(true, i),
        ),
        8 => (
            call("read_file", json!({"path": "src/size.rs"})),
            source_file("size", 3, i),
        ),
        9 => (
            call(
                "edit_file",
                json!({"path": "src/duration.rs", "old": "max: 12", "new": "max: 24"}),
            ),
            "Edited src/duration.rs: 1 replacement.".into(),
        ),
        10 => (call("run_tests", json!({})), test_output(false, i)),
        _ => (
            call("read_file", json!({"path": format!("src/extra_{i}.rs")})),
            source_file("extra", 3, i),
        ),
    }
}

/// The chat messages of request `turn` (0-based): system, task, then `turn` scripted
/// assistant/tool exchanges. Request `t + 1` extends request `t`.
pub fn messages(turn: usize) -> Value {
    let mut m = vec![
        json!({"role": "system", "content": system_prompt()}),
        json!({"role": "user", "content": "The test parse_case_07 fails since the last release. Find out why and fix it; keep the change minimal."}),
    ];
    for i in 0..turn {
        let (call, result) = step(i);
        m.push(json!({"role": "assistant", "content": call}));
        m.push(json!({"role": "tool", "content": result}));
    }
    Value::Array(m)
}

/// Turns in the default session (≥ 10, growing past 4,000 tokens with SmolLM2's tokenizer).
pub const DEFAULT_TURNS: usize = 13;
