//! Mooncake-format traces: one JSON object per line with `timestamp` (ms from the start),
//! `input_length` and `output_length` (tokens) and `hash_ids` (one id per 512-token block of
//! the prompt; equal ids at equal positions mean equal prefixes, the last block may be
//! partial). Parsing never panics: a bad line is an error that names its line number.

use std::io::BufRead;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde::Deserialize;

/// Tokens per hash id in a Mooncake trace (before `--token-scale`).
pub const TRACE_BLOCK_TOKENS: usize = 512;

/// One request of a trace, as written in the file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceRequest {
    /// Arrival time in milliseconds from the start of the trace.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: usize,
    /// Completion tokens.
    pub output_length: usize,
    /// One id per 512-token block of the prompt.
    pub hash_ids: Vec<u64>,
}

/// Parses a whole trace; blank lines are skipped. Errors name the 1-based line number.
pub fn parse(reader: impl BufRead) -> Result<Vec<TraceRequest>> {
    let mut out: Vec<TraceRequest> = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let n = i + 1;
        let line = line.with_context(|| format!("line {n}: reading"))?;
        if line.trim().is_empty() {
            continue;
        }
        let r: TraceRequest = serde_json::from_str(&line).with_context(|| {
            format!(
                "line {n}: not a trace record ({{\"timestamp\": ms, \"input_length\": tokens, \
                 \"output_length\": tokens, \"hash_ids\": [ids]}})"
            )
        })?;
        check(&r).map_err(|e| anyhow!("line {n}: {e}"))?;
        if let Some(prev) = out.last() {
            if r.timestamp < prev.timestamp {
                bail!(
                    "line {n}: timestamp {} is earlier than the previous request's {}: a trace \
                     must be in arrival order",
                    r.timestamp,
                    prev.timestamp
                );
            }
        }
        out.push(r);
    }
    Ok(out)
}

/// Reads and parses a trace file.
pub fn read(path: &Path) -> Result<Vec<TraceRequest>> {
    let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    parse(std::io::BufReader::new(f)).with_context(|| format!("reading {}", path.display()))
}

/// The lengths must agree with the block ids: `input_length` lies in the last block.
fn check(r: &TraceRequest) -> Result<()> {
    if r.input_length == 0 {
        bail!("input_length is 0");
    }
    let n = r.hash_ids.len();
    if n == 0 {
        bail!("hash_ids is empty");
    }
    let (lo, hi) = (
        (n.saturating_sub(1)) * TRACE_BLOCK_TOKENS,
        n * TRACE_BLOCK_TOKENS,
    );
    if r.input_length <= lo || r.input_length > hi {
        bail!(
            "input_length {} does not fit {} hash ids of {TRACE_BLOCK_TOKENS} tokens (expected \
             {}..={hi})",
            r.input_length,
            n,
            lo + 1
        );
    }
    Ok(())
}

/// A slice of the trace by arrival time, in seconds of trace time: `[start, end)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Window {
    /// First second taken (inclusive).
    pub start_s: f64,
    /// Second where the slice ends (exclusive); infinite when open.
    pub end_s: f64,
}

impl Window {
    /// Parses `START..END` in seconds (`600..1200`, `..300`, `900..`; fractions allowed).
    pub fn parse(s: &str) -> std::result::Result<Window, String> {
        let (a, b) = s
            .split_once("..")
            .ok_or_else(|| format!("{s:?}: expected START..END in seconds (e.g. 0..600)"))?;
        let num = |x: &str, default: f64| -> std::result::Result<f64, String> {
            let x = x.trim();
            if x.is_empty() {
                return Ok(default);
            }
            match x.parse::<f64>() {
                Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
                _ => Err(format!("{x:?} in {s:?} is not a number of seconds ≥ 0")),
            }
        };
        let w = Window {
            start_s: num(a, 0.0)?,
            end_s: num(b, f64::INFINITY)?,
        };
        if w.end_s <= w.start_s {
            return Err(format!("{s:?}: END must be after START"));
        }
        Ok(w)
    }

    /// The requests that arrive inside the window.
    pub fn select(&self, trace: &[TraceRequest]) -> Vec<TraceRequest> {
        trace
            .iter()
            .filter(|r| {
                let t = r.timestamp as f64 / 1000.0;
                t >= self.start_s && t < self.end_s
            })
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(text: &str) -> Result<Vec<TraceRequest>> {
        parse(text.as_bytes())
    }

    #[test]
    fn parses_records_and_skips_blank_lines() {
        let t = p(concat!(
            "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [0, 1]}\n",
            "\n",
            "{\"timestamp\": 7, \"input_length\": 512, \"output_length\": 1, \"hash_ids\": [0]}\n",
        ))
        .unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].hash_ids, vec![0, 1]);
        assert_eq!(t[1].timestamp, 7);
        assert_eq!(t[1].input_length, 512);
    }

    /// Every kind of bad line gives an error naming its line, never a panic.
    #[test]
    fn a_malformed_line_is_named() {
        let good =
            "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [3]}";
        for (bad, what) in [
            ("{\"timestamp\": 0, \"input_length\": 10", "not a trace record"),
            ("[1, 2]", "not a trace record"),
            (
                "{\"timestamp\": -1, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [3]}",
                "not a trace record",
            ),
            (
                "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1}",
                "not a trace record",
            ),
            (
                "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [3], \"x\": 1}",
                "not a trace record",
            ),
            (
                "{\"timestamp\": 0, \"input_length\": 0, \"output_length\": 1, \"hash_ids\": [3]}",
                "input_length is 0",
            ),
            (
                "{\"timestamp\": 0, \"input_length\": 513, \"output_length\": 1, \"hash_ids\": [3]}",
                "does not fit 1 hash ids",
            ),
            (
                "{\"timestamp\": 0, \"input_length\": 512, \"output_length\": 1, \"hash_ids\": [3, 4]}",
                "does not fit 2 hash ids",
            ),
            (
                "{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": []}",
                "hash_ids is empty",
            ),
        ] {
            let text = format!("{good}\n{good}\n{bad}\n{good}\n");
            let e = format!("{:#}", p(&text).unwrap_err());
            assert!(e.starts_with("line 3"), "{bad}: {e}");
            assert!(e.contains(what), "{bad}: {e}");
        }
        let e = format!(
            "{:#}",
            p(&format!(
                "{}\n{good}\n",
                good.replace("\"timestamp\": 0", "\"timestamp\": 9")
            ))
            .unwrap_err()
        );
        assert!(e.starts_with("line 2: timestamp 0 is earlier"), "{e}");
    }

    #[test]
    fn window_parses_and_selects_by_seconds() {
        assert_eq!(
            Window::parse("..2.5").unwrap(),
            Window {
                start_s: 0.0,
                end_s: 2.5
            }
        );
        assert_eq!(Window::parse("3..").unwrap().end_s, f64::INFINITY);
        for bad in ["5", "4..2", "a..3", "-1..3", "2..2"] {
            assert!(Window::parse(bad).is_err(), "{bad}");
        }
        let t: Vec<TraceRequest> = [0u64, 999, 1000, 2500, 3000]
            .iter()
            .map(|&ms| TraceRequest {
                timestamp: ms,
                input_length: 1,
                output_length: 1,
                hash_ids: vec![ms],
            })
            .collect();
        let got: Vec<u64> = Window::parse("1..3")
            .unwrap()
            .select(&t)
            .iter()
            .map(|r| r.timestamp)
            .collect();
        assert_eq!(got, vec![1000, 2500]);
    }
}
