//! Token ids back to text, one token at a time (the Renderer's output side).
//!
//! Two problems make this harder than `decode(all tokens)` every step:
//!
//! * **Split characters.** A byte-level BPE token may end in the middle of a
//!   multi-byte UTF-8 character; decoding it alone gives U+FFFD. The
//!   [`IncrementalDetokenizer`] decodes a short window of recent tokens and
//!   emits text only once it no longer ends in a replacement character, so a
//!   stream never carries a broken character.
//! * **Stop strings.** Text that could be the start of a stop string is held
//!   back until the next tokens rule the stop string in (it is cut, with
//!   everything after it) or out (the text is released): [`StopStrings`].
//!
//! [`TextStream`] combines the two for one sequence.

use vellum_base::TokenId;
use vellum_models::Tokenizer;

/// Tokens of the prompt kept as left context, so that tokenizers which
/// decide spacing from the previous token (SentencePiece) decode the first
/// generated token right.
const PROMPT_CONTEXT_TOKENS: usize = 5;

/// Decodes a growing token sequence into text increments.
#[derive(Clone, Debug)]
pub struct IncrementalDetokenizer {
    tokens: Vec<TokenId>,
    /// Start of the window decoded for context.
    prefix_offset: usize,
    /// End of the text already emitted.
    read_offset: usize,
    skip_special_tokens: bool,
}

impl IncrementalDetokenizer {
    /// A detokenizer for the output that follows `prompt`.
    pub fn new(prompt: &[TokenId], skip_special_tokens: bool) -> Self {
        let ctx = &prompt[prompt.len().saturating_sub(PROMPT_CONTEXT_TOKENS)..];
        Self { tokens: ctx.to_vec(), prefix_offset: 0, read_offset: ctx.len(), skip_special_tokens }
    }

    /// Appends `token`; returns the text it completes (possibly empty, when
    /// the token ends inside a character).
    pub fn push(&mut self, tokenizer: &Tokenizer, token: TokenId) -> vellum_models::Result<String> {
        self.tokens.push(token);
        let prefix = tokenizer.decode(&self.tokens[self.prefix_offset..self.read_offset], self.skip_special_tokens)?;
        let full = tokenizer.decode(&self.tokens[self.prefix_offset..], self.skip_special_tokens)?;
        if full.ends_with('\u{FFFD}') || full.len() <= prefix.len() {
            return Ok(String::new());
        }
        let new = match full.get(prefix.len()..) {
            Some(tail) if full.starts_with(&prefix) => tail.to_string(),
            // The window's decoding changed the earlier text (rare
            // normalisation effects): emit only what extends it.
            _ => full.chars().skip(prefix.chars().count()).collect(),
        };
        self.prefix_offset = self.read_offset;
        self.read_offset = self.tokens.len();
        Ok(new)
    }

    /// Text of tokens still held because they end inside a character,
    /// decoded as they are (with replacement characters).
    pub fn flush(&mut self, tokenizer: &Tokenizer) -> vellum_models::Result<String> {
        if self.read_offset == self.tokens.len() {
            return Ok(String::new());
        }
        let prefix = tokenizer.decode(&self.tokens[self.prefix_offset..self.read_offset], self.skip_special_tokens)?;
        let full = tokenizer.decode(&self.tokens[self.prefix_offset..], self.skip_special_tokens)?;
        self.prefix_offset = self.read_offset;
        self.read_offset = self.tokens.len();
        Ok(full.get(prefix.len()..).unwrap_or_default().to_string())
    }
}

/// What pushing text through [`StopStrings`] gave.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopCheck {
    /// Text that can be shown now (may be empty: held back).
    Text(String),
    /// A stop string matched: the text before it; generation ends.
    Stopped(String),
}

/// Finds stop strings in a text stream, holding back any tail that could
/// still become one.
#[derive(Clone, Debug, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    held: String,
    /// The stop string that matched, once one has.
    matched: Option<String>,
}

impl StopStrings {
    /// A checker for `stops` (empty strings are ignored).
    pub fn new(stops: &[String]) -> Self {
        Self { stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(), held: String::new(), matched: None }
    }

    /// Feeds new text.
    pub fn push(&mut self, text: &str) -> StopCheck {
        if self.stops.is_empty() {
            return StopCheck::Text(text.to_string());
        }
        self.held.push_str(text);
        // The earliest match; among matches at one place, the first listed.
        let first_match = self.stops.iter().filter_map(|s| self.held.find(s.as_str()).map(|at| (at, s))).min_by_key(|&(at, _)| at);
        if let Some((at, stop)) = first_match {
            self.matched = Some(stop.clone());
            let out = self.held[..at].to_string();
            self.held.clear();
            return StopCheck::Stopped(out);
        }
        let keep = self.longest_partial_match();
        let emit_to = self.held.len() - keep;
        let out = self.held[..emit_to].to_string();
        self.held.drain(..emit_to);
        StopCheck::Text(out)
    }

    /// The stop string that matched, if one has.
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// The text held back, released when the sequence ends without a match.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Length of the longest tail of `held` that is a proper prefix of a
    /// stop string.
    fn longest_partial_match(&self) -> usize {
        let mut best = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if i > best && self.held.ends_with(&s[..i]) {
                    best = i;
                }
            }
        }
        best
    }
}

/// The text of one generated sequence: detokenized increments with stop
/// strings held back and cut.
#[derive(Clone, Debug)]
pub struct TextStream {
    detok: IncrementalDetokenizer,
    stops: StopStrings,
    text: String,
    stopped: bool,
}

impl TextStream {
    /// A stream for the output after `prompt`.
    pub fn new(prompt: &[TokenId], stop: &[String], skip_special_tokens: bool) -> Self {
        Self {
            detok: IncrementalDetokenizer::new(prompt, skip_special_tokens),
            stops: StopStrings::new(stop),
            text: String::new(),
            stopped: false,
        }
    }

    /// Appends tokens; returns the text that may be shown now. After a stop
    /// string matched, further tokens are ignored.
    pub fn push(&mut self, tokenizer: &Tokenizer, tokens: &[TokenId]) -> vellum_models::Result<String> {
        let mut out = String::new();
        for &t in tokens {
            if self.stopped {
                break;
            }
            let piece = self.detok.push(tokenizer, t)?;
            match self.stops.push(&piece) {
                StopCheck::Text(s) => out.push_str(&s),
                StopCheck::Stopped(s) => {
                    out.push_str(&s);
                    self.stopped = true;
                }
            }
        }
        self.text.push_str(&out);
        Ok(out)
    }

    /// The sequence ended: releases held-back text (none after a stop).
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> vellum_models::Result<String> {
        if self.stopped {
            return Ok(String::new());
        }
        let tail = self.detok.flush(tokenizer)?;
        let mut out = match self.stops.push(&tail) {
            StopCheck::Text(s) => s,
            StopCheck::Stopped(s) => {
                self.stopped = true;
                s
            }
        };
        if !self.stopped {
            out.push_str(&self.stops.finish());
        }
        self.text.push_str(&out);
        Ok(out)
    }

    /// Whether a stop string matched.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// The stop string that ended the text, if one did.
    pub fn stop_string(&self) -> Option<&str> {
        self.stops.matched()
    }

    /// All text shown so far.
    pub fn text(&self) -> &str {
        &self.text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(stops: &[&str], pieces: &[&str]) -> (Vec<String>, bool) {
        let mut s = StopStrings::new(&stops.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        let mut out = Vec::new();
        for p in pieces {
            match s.push(p) {
                StopCheck::Text(t) => out.push(t),
                StopCheck::Stopped(t) => {
                    out.push(t);
                    return (out, true);
                }
            }
        }
        out.push(s.finish());
        (out, false)
    }

    #[test]
    fn the_stop_string_that_matched_first_is_named() {
        let mut s = StopStrings::new(&["never".to_string(), "END".to_string(), "ND".to_string()]);
        assert_eq!(s.matched(), None);
        assert!(matches!(s.push("text E"), StopCheck::Text(t) if t == "text "));
        // "E" was held back; "END" then starts the held text, before "ND".
        assert!(matches!(s.push("ND more"), StopCheck::Stopped(t) if t.is_empty()));
        assert_eq!(s.matched(), Some("END"), "END starts before ND");
    }

    #[test]
    fn stop_string_split_over_pieces_is_held_then_cut() {
        let (out, stopped) = feed(&["END"], &["hello E", "N", "D tail"]);
        assert!(stopped);
        assert_eq!(out, vec!["hello ", "", ""], "the 'E' and 'N' are held until ruled in");
        assert_eq!(out.concat(), "hello ");
    }

    #[test]
    fn partial_match_ruled_out_is_released() {
        let (out, stopped) = feed(&["END"], &["an E", "ND", "!"][..1].iter().chain(&["x"]).copied().collect::<Vec<_>>());
        assert!(!stopped);
        assert_eq!(out, vec!["an ", "Ex", ""]);
    }

    #[test]
    fn earliest_of_several_stops_wins_and_multibyte_is_safe() {
        let (out, stopped) = feed(&["ü!", "b"], &["aü", "!b"]);
        assert!(stopped);
        assert_eq!(out.concat(), "a");
        let (out, stopped) = feed(&["éé"], &["xé", "y"]);
        assert!(!stopped);
        assert_eq!(out.concat(), "xéy");
    }

    #[test]
    fn no_stops_passes_text_through() {
        let (out, stopped) = feed(&[], &["a", "b"]);
        assert!(!stopped);
        assert_eq!(out.concat(), "ab");
    }
}
