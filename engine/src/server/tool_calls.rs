//! Tool calls in a model's output, turned into OpenAI `tool_calls`.
//!
//! One parser per format family, chosen from the chat template's text ([`ToolFormat::detect`]):
//!
//! - [`ToolFormat::Hermes`]: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
//!   any number of them, with text around (Qwen2.5, Qwen3, Hermes).
//! - [`ToolFormat::Llama3Json`]: the whole reply is `{"name": ..., "parameters": {...}}`,
//!   optionally after `<|python_tag|>`, several separated by `;` (Llama 3.1 to 3.3).
//! - [`ToolFormat::GemmaToolCode`]: ```` ```tool_code ```` fenced blocks holding
//!   `{"name": ..., "arguments": {...}}`, with text around (Gemma 3 with the template
//!   set-up installs, scripts/goldens/templates/gemma3_tools.jinja).
//!
//! A call is taken only when its JSON parses, `name` is a string naming one of the request's
//! tools and the arguments are an object; anything else stays plain content. The arguments
//! string is the model's own text of the object (not re-serialized), so a template that
//! renders a string `arguments` verbatim reproduces the model's bytes in the next turn.
//!
//! [`CallStream`] does the same incrementally for streamed replies: text that cannot be part
//! of a call is released as soon as it arrives, a possible call opener is held back.

use serde_json::Value;

/// The tool-call convention of a chat template.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ToolFormat {
    /// `<tool_call>{json}</tool_call>` blocks (Qwen2.5, Qwen3, Hermes).
    Hermes,
    /// A reply that is JSON calls, optionally after `<|python_tag|>` (Llama 3.x).
    Llama3Json,
    /// ```` ```tool_code\n{json}\n``` ```` blocks (Gemma 3, whose own template has no
    /// tool calls: the fenced-block convention of Gemma's function-calling guide, holding
    /// the same JSON as a Hermes call).
    GemmaToolCode,
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const GEMMA_OPEN: &str = "```tool_code";
const GEMMA_CLOSE: &str = "```";
const PYTHON_TAG: &str = "<|python_tag|>";

impl ToolFormat {
    /// The family a chat template writes tool calls in, if it is one we parse.
    pub fn detect(template: &str) -> Option<ToolFormat> {
        if template.contains(HERMES_OPEN) {
            Some(ToolFormat::Hermes)
        } else if template.contains(GEMMA_OPEN) {
            Some(ToolFormat::GemmaToolCode)
        } else if template.contains(PYTHON_TAG)
            || (template.contains("<|start_header_id|>") && template.contains("\"parameters\""))
        {
            Some(ToolFormat::Llama3Json)
        } else {
            None
        }
    }

    /// The markers around one call of a block-delimited family (`None`: Llama's JSON).
    fn markers(self) -> Option<(&'static str, &'static str)> {
        match self {
            ToolFormat::Hermes => Some((HERMES_OPEN, HERMES_CLOSE)),
            ToolFormat::GemmaToolCode => Some((GEMMA_OPEN, GEMMA_CLOSE)),
            ToolFormat::Llama3Json => None,
        }
    }
}

/// How a tokenizer holds a call marker such as `<tool_call>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Marker {
    /// One token whose text is the marker (Qwen's `<tool_call>`).
    Token(u32),
    /// One special token, which decoding drops: the marker must be spelled out.
    Special,
    /// No token of its own: plain text.
    Text,
}

/// A function a forced tool call may name: its name and the JSON schema of its arguments.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ToolSpec {
    pub name: String,
    /// `parameters` as the request gave it (`{"type": "object"}` when it gave none).
    pub parameters: Value,
}

impl ToolFormat {
    /// The Lark grammar of a reply that is only calls in this format to `tools`, each call's
    /// arguments valid under its function's schema: exactly one call when `one`, else one
    /// or more (separated as the format separates them). `marker`: how the tokenizer holds
    /// a marker (`<tool_call>`, `</tool_call>`); one held as a single text token is written
    /// as that token, so that a constrained call holds the tokens the template renders when
    /// the call comes back in the history (a marker spelled out in pieces would
    /// re-tokenize differently).
    /// Calls are written as the parser reads them and as chat templates re-render them:
    /// `{"name": "...", "arguments": {...}}` (Llama 3: `"parameters"`), JSON with `", "`
    /// and `": "` separators. `or_document`: a rule body (a JSON schema's, from
    /// [`crate::json_schema_rule`]) the reply may be instead of calls.
    pub fn call_grammar(
        self,
        tools: &[ToolSpec],
        one: bool,
        marker: &dyn Fn(&str) -> Marker,
        or_document: Option<&str>,
    ) -> crate::Result<String> {
        use crate::{json_schema_rule, lark_literal};
        // llguidance tokenizes text the grammar forces canonically, and would then offer a
        // special token whose name is that text, which its parser refuses: with a marker
        // that is such a token, the model's own tokenization is taken instead.
        let mut no_forcing = false;
        let mut lark_marker = |m: &str| match marker(m) {
            Marker::Token(id) => format!("<[{id}]>"),
            Marker::Special => {
                no_forcing = true;
                lark_literal(m)
            }
            Marker::Text => lark_literal(m),
        };
        let key = match self {
            ToolFormat::Hermes | ToolFormat::GemmaToolCode => "arguments",
            ToolFormat::Llama3Json => "parameters",
        };
        let (opener, closer) = match self.markers() {
            Some((open, close)) => (
                format!("{} ", lark_marker(open)),
                format!(" {}", lark_marker(close)),
            ),
            None => (String::new(), String::new()),
        };
        let mut rules = Vec::new();
        let mut calls = Vec::new();
        for (i, t) in tools.iter().enumerate() {
            let head = format!("{{\"name\": {}, \"{key}\": ", Value::String(t.name.clone()));
            let (head, tail) = match self {
                ToolFormat::Hermes | ToolFormat::GemmaToolCode => (format!("\n{head}"), "}\n"),
                ToolFormat::Llama3Json => (head, "}"),
            };
            rules.push(format!(
                "call_{i}: {opener}{} args_{i} {}{closer}",
                lark_literal(&head),
                lark_literal(tail)
            ));
            rules.push(format!("args_{i}: {}", json_schema_rule(&t.parameters)?));
            calls.push(format!("call_{i}"));
        }
        // As the templates render several calls: Hermes blocks a newline apart, Gemma's
        // fenced blocks back to back, Llama's objects `; ` apart.
        let calls_rule = match self {
            _ if one => "calls: call".to_string(),
            ToolFormat::Hermes => format!("calls: call ({} call)*", lark_literal("\n")),
            ToolFormat::GemmaToolCode => "calls: call+".to_string(),
            ToolFormat::Llama3Json => format!("calls: call ({} call)*", lark_literal("; ")),
        };
        let start = match or_document {
            Some(doc) => format!("start: calls | document\ndocument: {doc}\n{calls_rule}"),
            None => format!("start: calls\n{calls_rule}"),
        };
        let options = if no_forcing {
            "%llguidance {\"no_forcing\": true}\n"
        } else {
            ""
        };
        Ok(format!(
            "{options}{start}\ncall: {}\n{}\n",
            calls.join(" | "),
            rules.join("\n")
        ))
    }
}

/// One parsed call: the function's name and its arguments as JSON text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ToolCall {
    pub name: String,
    /// The model's text of the arguments object.
    pub arguments: String,
}

/// A piece of a reply: text for `content`, or a complete call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Piece {
    Text(String),
    Call(ToolCall),
}

/// A whole reply split into `content` (None when only calls remain) and calls.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Parsed {
    pub content: Option<String>,
    pub calls: Vec<ToolCall>,
}

/// Parses a whole reply.
pub(crate) fn parse(format: ToolFormat, tools: &[String], text: &str) -> Parsed {
    let mut s = CallStream::new(format, tools.to_vec());
    let mut pieces = s.push(text);
    pieces.extend(s.finish());
    let mut content = String::new();
    let mut calls = Vec::new();
    for p in pieces {
        match p {
            Piece::Text(t) => content.push_str(&t),
            Piece::Call(c) => calls.push(c),
        }
    }
    if calls.is_empty() {
        return Parsed {
            content: Some(content),
            calls,
        };
    }
    let content = content.trim();
    Parsed {
        content: (!content.is_empty()).then(|| content.to_string()),
        calls,
    }
}

/// The raw text of each top-level member of the JSON object `s` (which must be exactly one
/// object, whitespace around allowed), in order; None if it is not one.
fn members(s: &str) -> Option<Vec<(String, &str)>> {
    let s = s.trim();
    let inner = s.strip_prefix('{')?.strip_suffix('}')?;
    // Validate the whole first: the scan below trusts its structure.
    if !serde_json::from_str::<Value>(s).ok()?.is_object() {
        return None;
    }
    let mut out = Vec::new();
    let mut rest = inner.trim_start();
    while !rest.is_empty() {
        let mut keys = serde_json::Deserializer::from_str(rest).into_iter::<String>();
        let key = keys.next()?.ok()?;
        rest = rest[keys.byte_offset()..].trim_start().strip_prefix(':')?;
        let lead = rest.len() - rest.trim_start().len();
        rest = &rest[lead..];
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        values.next()?.ok()?;
        let end = values.byte_offset();
        out.push((key, &rest[..end]));
        rest = rest[end..].trim_start();
        rest = rest.strip_prefix(',').unwrap_or(rest).trim_start();
    }
    Some(out)
}

/// A call from the JSON text of one call object, if it is a valid call of a known tool.
fn call_from_json(text: &str, tools: &[String]) -> Option<ToolCall> {
    let members = members(text)?;
    let get = |k: &str| members.iter().find(|(key, _)| key == k).map(|(_, v)| *v);
    let name: String = serde_json::from_str(get("name")?).ok()?;
    if !tools.contains(&name) {
        return None;
    }
    let args = get("arguments").or_else(|| get("parameters"))?;
    if !serde_json::from_str::<Value>(args).ok()?.is_object() {
        return None;
    }
    Some(ToolCall {
        name,
        arguments: args.to_string(),
    })
}

/// Llama 3 calls: the whole text is `<|python_tag|>`? then call objects separated by `;`.
fn llama_calls(text: &str, tools: &[String]) -> Option<Vec<ToolCall>> {
    let mut rest = text.trim_start();
    rest = rest.strip_prefix(PYTHON_TAG).unwrap_or(rest).trim_start();
    let mut calls = Vec::new();
    while !rest.is_empty() {
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        values.next()?.ok()?;
        let end = values.byte_offset();
        calls.push(call_from_json(&rest[..end], tools)?);
        rest = rest[end..].trim_start();
        if let Some(r) = rest.strip_prefix(';') {
            rest = r.trim_start();
            if rest.is_empty() {
                return None;
            }
        }
    }
    (!calls.is_empty()).then_some(calls)
}

/// The length of the longest suffix of `s` that is a proper prefix of `pat`.
fn partial_suffix(s: &str, pat: &str) -> usize {
    (1..pat.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && pat.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

#[derive(Debug)]
enum Mode {
    /// Hermes, Gemma: outside a call.
    Text,
    /// Hermes, Gemma: after an opener, waiting for its closer.
    InCall,
    /// Llama: nothing but whitespace seen yet.
    Start,
    /// Llama: the reply may be calls; everything is held to the end.
    MaybeCalls,
    /// Llama: the reply is text.
    Plain,
}

/// An incremental parser of one streamed reply.
#[derive(Debug)]
pub(crate) struct CallStream {
    format: ToolFormat,
    tools: Vec<String>,
    mode: Mode,
    /// Text received and not yet released.
    held: String,
    /// Whitespace-only text after a call, released only if more text follows.
    blank: String,
    calls: usize,
}

impl CallStream {
    /// A parser of `format` that takes calls of the functions named `tools`.
    pub fn new(format: ToolFormat, tools: Vec<String>) -> CallStream {
        let mode = match format {
            ToolFormat::Hermes | ToolFormat::GemmaToolCode => Mode::Text,
            ToolFormat::Llama3Json => Mode::Start,
        };
        CallStream {
            format,
            tools,
            mode,
            held: String::new(),
            blank: String::new(),
            calls: 0,
        }
    }

    /// Takes the next text of the reply; returns what can be released now.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.held.push_str(text);
        let mut out = Vec::new();
        let (open, close) = self.format.markers().unwrap_or(("", ""));
        loop {
            match self.mode {
                Mode::Text => {
                    if let Some(at) = self.held.find(open) {
                        let before: String = self.held.drain(..at).collect();
                        self.held.drain(..open.len());
                        self.text(before, &mut out);
                        self.mode = Mode::InCall;
                        continue;
                    }
                    let keep = partial_suffix(&self.held, open);
                    let ready: String = self.held.drain(..self.held.len() - keep).collect();
                    self.text(ready, &mut out);
                }
                Mode::InCall => {
                    if let Some(at) = self.held.find(close) {
                        let inner: String = self.held.drain(..at).collect();
                        self.held.drain(..close.len());
                        match call_from_json(&inner, &self.tools) {
                            Some(c) => self.call(c, &mut out),
                            None => self.text(format!("{open}{inner}{close}"), &mut out),
                        }
                        self.mode = Mode::Text;
                        continue;
                    }
                }
                Mode::Start => {
                    // Nothing yet, or a prefix of the tag: wait for more.
                    let t = self.held.trim_start();
                    if t.starts_with('{') || t.starts_with(PYTHON_TAG) {
                        self.mode = Mode::MaybeCalls;
                    } else if !PYTHON_TAG.starts_with(t) {
                        self.mode = Mode::Plain;
                        continue;
                    }
                }
                Mode::MaybeCalls => {}
                Mode::Plain => {
                    let all = std::mem::take(&mut self.held);
                    self.text(all, &mut out);
                }
            }
            return out;
        }
    }

    /// Ends the reply: releases what was held (calls completed at the very end included).
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        let held = std::mem::take(&mut self.held);
        match self.mode {
            Mode::InCall => {
                let open = self.format.markers().map_or("", |m| m.0);
                self.text(format!("{open}{held}"), &mut out)
            }
            Mode::Start | Mode::MaybeCalls if self.format == ToolFormat::Llama3Json => {
                match llama_calls(&held, &self.tools) {
                    Some(calls) => calls.into_iter().for_each(|c| self.call(c, &mut out)),
                    None => self.text(held, &mut out),
                }
            }
            _ => self.text(held, &mut out),
        }
        if self.calls == 0 && !self.blank.is_empty() {
            out.push(Piece::Text(std::mem::take(&mut self.blank)));
        }
        out
    }

    fn text(&mut self, t: String, out: &mut Vec<Piece>) {
        if t.is_empty() {
            return;
        }
        // Whitespace around calls is not content: hold it until real text follows.
        if t.trim().is_empty() {
            self.blank.push_str(&t);
            return;
        }
        let mut t = t;
        if !self.blank.is_empty() {
            t.insert_str(0, &std::mem::take(&mut self.blank));
        }
        match out.last_mut() {
            Some(Piece::Text(prev)) => prev.push_str(&t),
            _ => out.push(Piece::Text(t)),
        }
    }

    fn call(&mut self, c: ToolCall, out: &mut Vec<Piece>) {
        self.blank.clear();
        self.calls += 1;
        out.push(Piece::Call(c));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<String> {
        vec!["get_weather".into(), "search".into()]
    }

    fn call(name: &str, arguments: &str) -> ToolCall {
        ToolCall {
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    #[test]
    fn templates_choose_their_family() {
        let chatml = include_str!("../../tests/goldens/chatml_tools.jinja");
        let header = include_str!("../../tests/goldens/header_tools.jinja");
        assert_eq!(ToolFormat::detect(chatml), Some(ToolFormat::Hermes));
        assert_eq!(ToolFormat::detect(header), Some(ToolFormat::Llama3Json));
        let gemma = include_str!("../../../scripts/goldens/templates/gemma3_tools.jinja");
        assert_eq!(ToolFormat::detect(gemma), Some(ToolFormat::GemmaToolCode));
        let smollm2 = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' \
                       + message['content'] + '<|im_end|>\n'}}{% endfor %}";
        assert_eq!(ToolFormat::detect(smollm2), None);
    }

    /// Gemma's fenced blocks: text around, two calls back to back (as the template renders
    /// them), the arguments' bytes kept; a block that is not a valid call stays content.
    #[test]
    fn gemma_tool_code_blocks_are_calls() {
        let text = "Sure.\n```tool_code\n{\"name\": \"get_weather\", \"arguments\": {\"city\":  \"Paris\"}}\n``````tool_code\n{\"name\": \"search\", \"arguments\": {}}\n```";
        let p = parse(ToolFormat::GemmaToolCode, &tools(), text);
        assert_eq!(p.content.as_deref(), Some("Sure."));
        assert_eq!(
            p.calls,
            vec![
                call("get_weather", "{\"city\":  \"Paris\"}"),
                call("search", "{}")
            ]
        );
        let bad = "```tool_code\nprint(1)\n```";
        let p = parse(ToolFormat::GemmaToolCode, &tools(), bad);
        assert_eq!((p.content.as_deref(), p.calls.len()), (Some(bad), 0));
        // Streamed a few bytes at a time, the same calls come out, none of the fence as text.
        let mut s = CallStream::new(ToolFormat::GemmaToolCode, tools());
        let mut pieces = Vec::new();
        for chunk in text.as_bytes().chunks(3) {
            pieces.extend(s.push(std::str::from_utf8(chunk).unwrap()));
        }
        pieces.extend(s.finish());
        let calls: Vec<_> = pieces
            .iter()
            .filter_map(|p| match p {
                Piece::Call(c) => Some(c.clone()),
                Piece::Text(_) => None,
            })
            .collect();
        assert_eq!(calls.len(), 2);
        assert!(pieces
            .iter()
            .all(|p| !matches!(p, Piece::Text(t) if t.contains('`'))));
    }

    /// What the Gemma template renders for an assistant's calls parses back to the same
    /// calls with the same argument bytes (the next turn's prefix is what the model wrote).
    #[test]
    fn gemma_template_renders_calls_the_parser_reads_back() {
        let template = include_str!("../../../scripts/goldens/templates/gemma3_tools.jinja");
        let messages = serde_json::json!([
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function":
                    {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        ]);
        let mut ctx = std::collections::BTreeMap::new();
        ctx.insert(
            "messages".to_string(),
            minijinja::Value::from_serialize(&messages),
        );
        ctx.insert("bos_token".to_string(), minijinja::Value::from("<bos>"));
        ctx.insert(
            "add_generation_prompt".to_string(),
            minijinja::Value::from(false),
        );
        let text = crate::tokenizer::render_template(template, ctx).unwrap();
        let reply = text
            .split("<start_of_turn>model\n")
            .nth(1)
            .unwrap()
            .trim_end_matches("<end_of_turn>\n");
        assert_eq!(
            reply,
            "```tool_code\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n```"
        );
        let p = parse(ToolFormat::GemmaToolCode, &tools(), reply);
        assert_eq!(p.calls, vec![call("get_weather", "{\"city\": \"Paris\"}")]);
    }

    #[test]
    fn hermes_one_call_is_only_calls() {
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let p = parse(ToolFormat::Hermes, &tools(), text);
        assert_eq!(p.content, None);
        assert_eq!(p.calls, vec![call("get_weather", r#"{"city": "Paris"}"#)]);
    }

    #[test]
    fn hermes_keeps_the_arguments_bytes_the_model_wrote() {
        let text =
            "<tool_call>{\"arguments\":{ \"b\" :1,\"a\":[2, 3] },\"name\":\"search\"}</tool_call>";
        let p = parse(ToolFormat::Hermes, &tools(), text);
        assert_eq!(p.calls, vec![call("search", r#"{ "b" :1,"a":[2, 3] }"#)]);
    }

    #[test]
    fn hermes_text_around_and_several_calls() {
        let text = "Let me look.\n<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": \"a\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>\nDone.";
        let p = parse(ToolFormat::Hermes, &tools(), text);
        assert_eq!(p.content.as_deref(), Some("Let me look.\n\nDone."));
        assert_eq!(
            p.calls,
            vec![call("search", r#"{"q": "a"}"#), call("get_weather", "{}")]
        );
    }

    #[test]
    fn hermes_invalid_json_unknown_functions_and_bad_arguments_stay_content() {
        for text in [
            "<tool_call>{\"name\": \"search\", \"arguments\": {\"q\": }</tool_call>",
            "<tool_call>{\"name\": \"rm_rf\", \"arguments\": {}}</tool_call>",
            "<tool_call>{\"name\": \"search\", \"arguments\": \"q\"}</tool_call>",
            "<tool_call>{\"name\": 7, \"arguments\": {}}</tool_call>",
            "<tool_call>[1, 2]</tool_call>",
            "<tool_call>{\"name\": \"search\", \"arguments\": {}}",
            "Plain text with a < sign and <tool_ in it",
        ] {
            let p = parse(ToolFormat::Hermes, &tools(), text);
            assert_eq!(p.content.as_deref(), Some(text), "{text}");
            assert!(p.calls.is_empty(), "{text}");
        }
    }

    #[test]
    fn hermes_a_bad_call_beside_a_good_one_stays_content() {
        let text = "<tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"search\", \"arguments\": {}}</tool_call>";
        let p = parse(ToolFormat::Hermes, &tools(), text);
        assert_eq!(
            p.content.as_deref(),
            Some("<tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call>")
        );
        assert_eq!(p.calls, vec![call("search", "{}")]);
    }

    #[test]
    fn llama_calls_with_and_without_the_python_tag() {
        let p = parse(
            ToolFormat::Llama3Json,
            &tools(),
            "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}",
        );
        assert_eq!(p.content, None);
        assert_eq!(p.calls, vec![call("get_weather", r#"{"city": "Paris"}"#)]);
        let p = parse(
            ToolFormat::Llama3Json,
            &tools(),
            "<|python_tag|>{\"name\": \"search\", \"arguments\": {\"q\": \"x\"}}; {\"name\": \"get_weather\", \"parameters\": {}}\n",
        );
        assert_eq!(
            p.calls,
            vec![call("search", r#"{"q": "x"}"#), call("get_weather", "{}")]
        );
    }

    #[test]
    fn llama_invalid_unknown_or_text_around_stays_content() {
        for text in [
            "{\"name\": \"get_weather\", \"parameters\": {\"city\": }",
            "{\"name\": \"launch\", \"parameters\": {}}",
            "Sure: {\"name\": \"search\", \"parameters\": {}}",
            "{\"name\": \"search\", \"parameters\": {}} and then some text",
            "{\"name\": \"search\", \"parameters\": {}};",
            "{\"a\": 1}",
            "The answer is 42.",
            "<|python_tag|>print(1)",
        ] {
            let p = parse(ToolFormat::Llama3Json, &tools(), text);
            assert_eq!(p.content.as_deref(), Some(text), "{text}");
            assert!(p.calls.is_empty(), "{text}");
        }
    }

    /// Feeds `text` in pieces of `step` chars; returns the released pieces in order.
    fn stream(format: ToolFormat, text: &str, step: usize) -> Vec<Piece> {
        let mut s = CallStream::new(format, tools());
        let chars: Vec<char> = text.chars().collect();
        let mut out = Vec::new();
        for chunk in chars.chunks(step) {
            out.extend(s.push(&chunk.iter().collect::<String>()));
        }
        out.extend(s.finish());
        // Merge adjacent text, as a client concatenating deltas would.
        let mut merged: Vec<Piece> = Vec::new();
        for p in out {
            match (merged.last_mut(), p) {
                (Some(Piece::Text(a)), Piece::Text(b)) => a.push_str(&b),
                (_, p) => merged.push(p),
            }
        }
        merged
    }

    #[test]
    fn streamed_hermes_releases_text_before_a_call_and_holds_the_opener() {
        let mut s = CallStream::new(ToolFormat::Hermes, tools());
        assert_eq!(
            s.push("Let me check <to"),
            vec![Piece::Text("Let me check ".into())]
        );
        assert_eq!(s.push("ol_call>{\"name\": \"search\", "), vec![]);
        assert_eq!(
            s.push("\"arguments\": {}}</tool_call>"),
            vec![Piece::Call(call("search", "{}"))]
        );
        assert_eq!(s.push("\n"), vec![]);
        assert_eq!(s.finish(), vec![]);
        assert_eq!(s.calls, 1);
        // Not an opener after all: the held text is released.
        let mut s = CallStream::new(ToolFormat::Hermes, tools());
        assert_eq!(s.push("a <tool"), vec![Piece::Text("a ".into())]);
        assert_eq!(s.push("box> b"), vec![Piece::Text("<toolbox> b".into())]);
    }

    #[test]
    fn streamed_output_matches_the_whole_parse_at_every_split() {
        let texts = [
            "Let me look.\n<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": \"é\"}}\n</tool_call>\n<tool_call>{\"name\": \"nope\", \"arguments\": {}}</tool_call>",
            "plain «text» <tool_ with no call",
            "<tool_call>{\"name\": \"search\", \"arguments\": {}}",
        ];
        for text in texts {
            let whole = parse(ToolFormat::Hermes, &tools(), text);
            for step in 1..8 {
                let pieces = stream(ToolFormat::Hermes, text, step);
                let calls: Vec<ToolCall> = pieces
                    .iter()
                    .filter_map(|p| match p {
                        Piece::Call(c) => Some(c.clone()),
                        _ => None,
                    })
                    .collect();
                let content: String = pieces
                    .iter()
                    .filter_map(|p| match p {
                        Piece::Text(t) => Some(t.as_str()),
                        _ => None,
                    })
                    .collect();
                assert_eq!(calls, whole.calls, "{text} / {step}");
                // Whitespace next to a call may differ: a streamed reply cannot take back
                // the newline it sent before an opener.
                let words = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
                assert_eq!(
                    words(&content),
                    words(whole.content.as_deref().unwrap_or("")),
                    "{text} / {step}"
                );
            }
        }
    }

    #[test]
    fn streamed_llama_text_passes_through_and_calls_wait_for_the_end() {
        let mut s = CallStream::new(ToolFormat::Llama3Json, tools());
        assert_eq!(s.push("  "), vec![]);
        assert_eq!(s.push("Hi"), vec![Piece::Text("  Hi".into())]);
        assert_eq!(s.push(" there"), vec![Piece::Text(" there".into())]);
        let mut s = CallStream::new(ToolFormat::Llama3Json, tools());
        assert_eq!(s.push("<|python"), vec![]);
        assert_eq!(s.push("_tag|>{\"name\": \"search\","), vec![]);
        assert_eq!(s.push(" \"parameters\": {}}"), vec![]);
        assert_eq!(s.finish(), vec![Piece::Call(call("search", "{}"))]);
        let mut s = CallStream::new(ToolFormat::Llama3Json, tools());
        assert_eq!(s.push("{not json"), vec![]);
        assert_eq!(s.finish(), vec![Piece::Text("{not json".into())]);
    }
}
