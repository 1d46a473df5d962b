//! Text from outside (file names in a store directory, cache salts, model names, paths)
//! made safe to print on a terminal or in a log line.

use std::borrow::Cow;

/// `s` with every control character (C0, DEL, C1), every Unicode bidirectional override and
/// the backslash written as an escape (`\n`, `\x1b`, `\u{202e}`, `\\`), so the text can
/// neither move the cursor, recolour or retitle a terminal, start a fake line, nor be
/// mistaken for an escape it did not contain. Borrowed when nothing needed escaping.
pub fn escape_control(s: &str) -> Cow<'_, str> {
    let needs = |c: char| {
        c.is_control()
            || c == '\\'
            || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
    };
    if !s.chars().any(needs) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x80 && needs(c) => out.push_str(&format!("\\x{:02x}", c as u32)),
            c if needs(c) => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// [`escape_control`] of a path's text (lossy for non-UTF-8 names).
pub fn escape_path(p: &std::path::Path) -> String {
    escape_control(&p.to_string_lossy()).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_and_overrides_are_escaped() {
        assert!(matches!(escape_control("plain text é"), Cow::Borrowed(_)));
        assert_eq!(
            escape_control("a\x1b]0;owned\x07\nnamespace fake\r\u{202e}\\"),
            "a\\x1b]0;owned\\x07\\nnamespace fake\\r\\u{202e}\\\\"
        );
        assert_eq!(escape_control("\u{9b}31m"), "\\u{9b}31m");
    }
}
