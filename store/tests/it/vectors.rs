//! The key test vectors printed in docs/store-format.md, checked against the code, so the
//! document stays a specification another implementation can follow.

use store::{block_key, chain_keys, NamespaceDescription, NamespaceId};

fn vectors() -> Vec<String> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/store-format.md");
    let doc = std::fs::read_to_string(path).expect("docs/store-format.md is readable");
    doc.lines()
        .filter(|l| l.starts_with("vector "))
        .map(str::to_owned)
        .collect()
}

fn parse_tokens(s: &str) -> Vec<u32> {
    let s = s.trim_start_matches('[').trim_end_matches(']');
    if s.is_empty() {
        return Vec::new();
    }
    s.split(',').map(|t| t.trim().parse().unwrap()).collect()
}

#[test]
fn documented_key_vectors_match_the_code() {
    let vs = vectors();
    assert!(
        vs.len() >= 6,
        "expected at least 6 vectors in the doc, found {}",
        vs.len()
    );
    let mut failures = Vec::new();
    for v in &vs {
        let (lhs, expected) = v.rsplit_once(" => ").expect("vector line has ' => '");
        let expected = expected.trim();
        let got = if let Some(rest) = lhs.strip_prefix("vector namespace_bytes ") {
            let d: NamespaceDescription = serde_json::from_str(rest).unwrap();
            d.canonical_bytes()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect()
        } else if let Some(rest) = lhs.strip_prefix("vector namespace ") {
            let d: NamespaceDescription = serde_json::from_str(rest).unwrap();
            d.id().to_string()
        } else if let Some(rest) = lhs.strip_prefix("vector block_key ") {
            let (parent, toks) = rest.split_once(' ').unwrap();
            let parent: NamespaceId = parent.trim_start_matches("parent=").parse().unwrap();
            let toks = parse_tokens(toks.trim_start_matches("tokens="));
            block_key(&parent.0, &toks).to_string()
        } else if let Some(rest) = lhs.strip_prefix("vector chain_keys ") {
            let mut parts = rest.split(' ');
            let ns: NamespaceId = parts
                .next()
                .unwrap()
                .trim_start_matches("ns=")
                .parse()
                .unwrap();
            let bs: usize = parts
                .next()
                .unwrap()
                .trim_start_matches("block_size=")
                .parse()
                .unwrap();
            let toks = parse_tokens(parts.next().unwrap().trim_start_matches("tokens="));
            chain_keys(ns, &toks, bs)
                .iter()
                .map(|k| k.to_string())
                .collect::<Vec<_>>()
                .join(",")
        } else {
            panic!("unknown vector kind: {v}");
        };
        if got != expected {
            failures.push(format!("{lhs}\n  doc:  {expected}\n  code: {got}"));
        }
    }
    assert!(
        failures.is_empty(),
        "vectors differ:\n{}",
        failures.join("\n")
    );
}
