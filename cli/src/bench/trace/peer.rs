//! mlx-lm's `mlx_lm.server` as a replay target (the peer arm): started as a child process on
//! the model's Hugging Face folder, sent each prompt as the text the model's tokenizer
//! decodes its token ids to (mlx_lm.server takes no token ids), streamed and greedy. It
//! re-tokenizes that text, so two prompts that share token ids need not share tokens
//! there: [`retokenized_prefix_share`] says how much of the trace's prompts survives the
//! round trip. mlx-lm reports its prompt and cached tokens in its own tokens, so the arm's
//! hit share is of the prompts as it tokenized them.

use anyhow::{Context, Result};
use engine::Tokenizer;
use serde_json::json;

use super::dispatch::{Outcome, Target};
use super::http::HttpTarget;

/// Sends prompts to a server as text.
pub struct TextTarget {
    /// The server.
    pub http: HttpTarget,
    /// Decodes the trace's token ids to the text sent.
    pub tokenizer: Tokenizer,
}

impl Target for TextTarget {
    fn send(&self, prompt: Vec<u32>, max_tokens: usize) -> Outcome {
        let text = match self.tokenizer.decode(&prompt, false) {
            Ok(t) => t,
            Err(e) => return Outcome::failed(format!("decoding the prompt to text: {e}")),
        };
        // mlx_lm.server rejects `logprobs` on completions: one event per piece of text.
        match self.http.stream_completion(json!(text), max_tokens, false) {
            Ok(s) => {
                let mut o = s.outcome;
                if o.prompt_tokens == 0 {
                    o.prompt_tokens = prompt.len();
                }
                o
            }
            Err(e) => Outcome::failed(format!("{e:#}")),
        }
    }
}

/// Of all prompt tokens, the share that re-tokenizing the decoded text gives back as the
/// same leading ids (per prompt, the longest common prefix of the ids and
/// `encode(decode(ids))`, without special tokens): an upper bound of the prefix hits a
/// server that re-tokenizes can find.
pub fn retokenized_prefix_share(tokenizer: &Tokenizer, prompts: &[Vec<u32>]) -> Result<f64> {
    let (mut kept, mut total) = (0usize, 0usize);
    for ids in prompts {
        let text = tokenizer
            .decode(ids, false)
            .map_err(|e| anyhow::anyhow!("decoding a prompt: {e}"))?;
        let again = tokenizer
            .encode(&text, false)
            .map_err(|e| anyhow::anyhow!("encoding a decoded prompt: {e}"))
            .context("re-tokenizing")?;
        kept += ids.iter().zip(&again).take_while(|(a, b)| a == b).count();
        total += ids.len();
    }
    Ok(kept as f64 / total.max(1) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_that_round_trips_keeps_every_token_and_a_merge_loses_the_rest() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../engine/tests/goldens/tiny-llama");
        let tok = Tokenizer::from_folder(&dir).unwrap();
        // Ids of a sentence round-trip exactly.
        let ids = tok.encode("the cat sat on the mat", false).unwrap();
        assert_eq!(
            retokenized_prefix_share(&tok, std::slice::from_ref(&ids)).unwrap(),
            1.0
        );
        // Single characters that the tokenizer merges come back as fewer, other ids: the
        // prompt keeps nothing past the first merge.
        let chars: Vec<u32> = "the"
            .chars()
            .map(|c| tok.encode(&c.to_string(), false).unwrap()[0])
            .collect();
        let merged = tok.encode("the", false).unwrap();
        assert!(merged.len() < chars.len(), "{merged:?} vs {chars:?}");
        let share = retokenized_prefix_share(&tok, &[ids.clone(), chars.clone()]).unwrap();
        let kept = ids.len()
            + chars
                .iter()
                .zip(&merged)
                .take_while(|(a, b)| a == b)
                .count();
        let want = kept as f64 / (ids.len() + chars.len()) as f64;
        assert!(
            (share - want).abs() < 1e-12 && share < 1.0,
            "{share} vs {want}"
        );
    }
}
