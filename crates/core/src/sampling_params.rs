//! Sampling parameters, as the OpenAI API and vLLM name them.

use crate::{Error, PoolingParams, Result, TokenId};
use serde::{Deserialize, Serialize};

/// Most top log-probabilities a caller may ask for per position (vLLM's
/// default `max_logprobs`).
pub const MAX_LOGPROBS: usize = 20;

/// Beam search settings (paper §4.4): `beam_width` candidates kept per step,
/// the final ranking uses `cumulative_logprob / len^length_penalty`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BeamSearchParams {
    /// Candidates kept per step (≥ 1).
    pub beam_width: usize,
    /// Exponent of the length normalisation (1.0 = mean log-prob).
    pub length_penalty: f32,
}

/// A constraint on the output's form (vLLM's structured outputs): decoding
/// only ever picks tokens that keep the text a prefix of a string the
/// constraint accepts, and the end of text only where it is complete.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StructuredOutput {
    /// JSON valid under this JSON Schema (the schema as JSON text).
    Json(String),
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// Text matching this regular expression, whole.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A context-free grammar in llguidance's Lark syntax.
    Grammar(String),
}

impl StructuredOutput {
    /// The request field vLLM names it by (for error messages).
    pub fn field(&self) -> &'static str {
        match self {
            StructuredOutput::Json(_) => "structured_outputs.json",
            StructuredOutput::JsonObject => "response_format",
            StructuredOutput::Regex(_) => "structured_outputs.regex",
            StructuredOutput::Choice(_) => "structured_outputs.choice",
            StructuredOutput::Grammar(_) => "structured_outputs.grammar",
        }
    }
}

/// What a caller asks of one request. Construct with `Default` and struct
/// update syntax, then call [`SamplingParams::validate`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Number of output sequences returned.
    pub n: usize,
    /// Number of sequences generated, of which the best `n` are returned.
    pub best_of: Option<usize>,
    /// Softmax temperature; 0 means greedy.
    pub temperature: f32,
    /// Nucleus sampling: keep the smallest set of tokens whose mass ≥ top_p.
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens; 0 or -1 disables.
    pub top_k: i32,
    /// Drop tokens whose probability is below `min_p` × the top probability.
    pub min_p: f32,
    /// Seed of the request's own random generator.
    pub seed: Option<u64>,
    /// Penalty added once for every token already generated (OpenAI).
    pub presence_penalty: f32,
    /// Penalty scaled by how often a token was generated (OpenAI).
    pub frequency_penalty: f32,
    /// Multiplicative penalty on tokens seen in prompt or output (1 = off).
    pub repetition_penalty: f32,
    /// Strings that end generation; they are not part of the output.
    pub stop: Vec<String>,
    /// Token ids that end generation.
    pub stop_token_ids: Vec<TokenId>,
    /// Keep generating after the end-of-sequence token.
    pub ignore_eos: bool,
    /// Most tokens to generate; `None` = up to the model's length limit.
    pub max_tokens: Option<usize>,
    /// Fewest tokens to generate before EOS or stop tokens may end it.
    pub min_tokens: usize,
    /// Number of top log-probabilities returned per generated token.
    pub logprobs: Option<usize>,
    /// Number of top log-probabilities returned per prompt token.
    pub prompt_logprobs: Option<usize>,
    /// Beam search instead of sampling.
    pub beam_search: Option<BeamSearchParams>,
    /// Added to the logits of these tokens before sampling (OpenAI's
    /// `logit_bias`, each in [-100, 100]).
    pub logit_bias: Vec<(TokenId, f32)>,
    /// Constrains the output's form (JSON schema, regex, choice, grammar).
    pub structured_output: Option<StructuredOutput>,
    /// An embedding request: the prompt's hidden states are pooled into
    /// one vector ([`crate::PoolingParams`]) and nothing is sampled.
    pub pooling: Option<PoolingParams>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            n: 1,
            best_of: None,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            max_tokens: Some(16),
            min_tokens: 0,
            logprobs: None,
            prompt_logprobs: None,
            beam_search: None,
            logit_bias: Vec::new(),
            structured_output: None,
            pooling: None,
        }
    }
}

fn invalid(param: &'static str, message: impl Into<String>) -> Error {
    Error::InvalidSamplingParam { param, message: message.into() }
}

fn finite(param: &'static str, v: f32) -> Result<()> {
    if v.is_finite() {
        Ok(())
    } else {
        Err(invalid(param, format!("must be a finite number, got {v}")))
    }
}

impl SamplingParams {
    /// Greedy decoding of up to `max_tokens` tokens.
    pub fn greedy(max_tokens: usize) -> Self {
        Self { temperature: 0.0, max_tokens: Some(max_tokens), ..Self::default() }
    }

    /// True when sampling reduces to arg-max.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 && self.beam_search.is_none()
    }

    /// Whether a row's argmax is all the sampler needs of it: greedy, one
    /// sequence, no logprobs of any kind, no penalties, bias, constraint or
    /// minimum length. A step whose rows all say so may take the argmax
    /// from the device instead of the logits
    /// ([`ForwardBatch::argmax_only`](crate::ForwardBatch::argmax_only)).
    pub fn argmax_suffices(&self) -> bool {
        self.is_greedy()
            && !self.needs_sampled_logprobs()
            && self.prompt_logprobs.is_none()
            && self.num_sequences() == 1
            && self.presence_penalty == 0.0
            && self.frequency_penalty == 0.0
            && self.repetition_penalty == 1.0
            && self.logit_bias.is_empty()
            && self.structured_output.is_none()
            && self.min_tokens == 0
    }

    /// Whether the chosen tokens' log-probabilities are wanted: `logprobs`
    /// asked for (0 = the chosen token's alone), `best_of` ranking more
    /// samples than it returns, or a beam search. Otherwise the sampler
    /// skips normalizing the row (one pass of `exp` over the vocabulary,
    /// 262,144 entries on Gemma 3) and the outputs carry no logprobs, as
    /// vLLM's do not.
    pub fn needs_sampled_logprobs(&self) -> bool {
        self.logprobs.is_some() || self.beam_search.is_some() || self.num_sequences() > self.n
    }

    /// Number of sequences the engine runs for this request: `best_of`,
    /// else `n`; the beam width for a beam search.
    pub fn num_sequences(&self) -> usize {
        match &self.beam_search {
            Some(b) => b.beam_width,
            None => self.best_of.unwrap_or(self.n),
        }
    }

    /// Checks every field's range and the fields' consistency. Errors name
    /// the parameter as the OpenAI / vLLM API spells it.
    pub fn validate(&self) -> Result<()> {
        if self.n < 1 {
            return Err(invalid("n", format!("must be at least 1, got {}", self.n)));
        }
        if let Some(best_of) = self.best_of {
            if best_of < self.n {
                return Err(invalid("best_of", format!("must be greater than or equal to n ({}), got {best_of}", self.n)));
            }
            if best_of > 1 && self.is_greedy() {
                return Err(invalid("best_of", "must be 1 when using greedy sampling (temperature 0)"));
            }
        }
        for (name, v) in [
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("min_p", self.min_p),
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
            ("repetition_penalty", self.repetition_penalty),
        ] {
            finite(name, v)?;
        }
        if self.temperature < 0.0 {
            return Err(invalid("temperature", format!("must be non-negative, got {}", self.temperature)));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(invalid("top_p", format!("must be in (0, 1], got {}", self.top_p)));
        }
        if self.top_k < -1 {
            return Err(invalid("top_k", format!("must be -1 or 0 (disable) or at least 1, got {}", self.top_k)));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(invalid("min_p", format!("must be in [0, 1], got {}", self.min_p)));
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return Err(invalid("presence_penalty", format!("must be in [-2, 2], got {}", self.presence_penalty)));
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return Err(invalid("frequency_penalty", format!("must be in [-2, 2], got {}", self.frequency_penalty)));
        }
        if self.repetition_penalty <= 0.0 {
            return Err(invalid("repetition_penalty", format!("must be greater than 0, got {}", self.repetition_penalty)));
        }
        if let Some(max_tokens) = self.max_tokens {
            if max_tokens < 1 {
                return Err(invalid("max_tokens", format!("must be at least 1, got {max_tokens}")));
            }
            if self.min_tokens > max_tokens {
                return Err(invalid(
                    "min_tokens",
                    format!("must be less than or equal to max_tokens ({max_tokens}), got {}", self.min_tokens),
                ));
            }
        }
        for &(token, bias) in &self.logit_bias {
            if !(-100.0..=100.0).contains(&bias) {
                return Err(invalid("logit_bias", format!("bias of token {token} must be in [-100, 100], got {bias}")));
            }
        }
        if self.stop.iter().any(String::is_empty) {
            return Err(invalid("stop", "stop strings must not be empty"));
        }
        for (name, v) in [("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)] {
            if let Some(k) = v {
                if k > MAX_LOGPROBS {
                    return Err(invalid(name, format!("must be at most {MAX_LOGPROBS}, got {k}")));
                }
            }
        }
        if self.pooling.is_some() {
            let sampling_only = [
                ("n", self.n > 1),
                ("best_of", self.best_of.is_some_and(|b| b > 1)),
                ("logprobs", self.logprobs.is_some()),
                ("prompt_logprobs", self.prompt_logprobs.is_some()),
                ("use_beam_search", self.beam_search.is_some()),
                ("structured_outputs", self.structured_output.is_some()),
            ];
            if let Some((name, _)) = sampling_only.iter().find(|(_, set)| *set) {
                return Err(invalid(name, "applies to generation, not to a pooling (embedding) request"));
            }
        }
        if let Some(beam) = &self.beam_search {
            if beam.beam_width < 1 {
                return Err(invalid("beam_width", format!("must be at least 1, got {}", beam.beam_width)));
            }
            finite("length_penalty", beam.length_penalty)?;
            if self.n > beam.beam_width {
                return Err(invalid("n", format!("must be at most the beam width ({}), got {}", beam.beam_width, self.n)));
            }
            if self.best_of.is_some() {
                return Err(invalid("best_of", "is not supported together with beam search"));
            }
            if let Some(so) = &self.structured_output {
                return Err(invalid(so.field(), "structured outputs are not supported together with beam search"));
            }
        }
        match &self.structured_output {
            Some(StructuredOutput::Choice(c)) if c.is_empty() || c.iter().any(String::is_empty) => {
                return Err(invalid("structured_outputs.choice", "must be a non-empty list of non-empty strings"));
            }
            Some(so @ (StructuredOutput::Regex(t) | StructuredOutput::Grammar(t) | StructuredOutput::Json(t))) if t.trim().is_empty() => {
                return Err(invalid(so.field(), "must not be empty"));
            }
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err_param(p: SamplingParams) -> &'static str {
        match p.validate() {
            Err(Error::InvalidSamplingParam { param, .. }) => param,
            other => panic!("expected an invalid parameter, got {other:?}"),
        }
    }

    #[test]
    fn defaults_are_valid() {
        SamplingParams::default().validate().unwrap();
        SamplingParams::greedy(8).validate().unwrap();
    }

    #[test]
    fn each_bad_field_names_itself() {
        let d = SamplingParams::default;
        assert_eq!(err_param(SamplingParams { n: 0, ..d() }), "n");
        assert_eq!(err_param(SamplingParams { n: 3, best_of: Some(2), ..d() }), "best_of");
        assert_eq!(err_param(SamplingParams { temperature: -0.5, ..d() }), "temperature");
        assert_eq!(err_param(SamplingParams { temperature: f32::NAN, ..d() }), "temperature");
        assert_eq!(err_param(SamplingParams { top_p: 0.0, ..d() }), "top_p");
        assert_eq!(err_param(SamplingParams { top_p: 1.5, ..d() }), "top_p");
        assert_eq!(err_param(SamplingParams { top_k: -2, ..d() }), "top_k");
        assert_eq!(err_param(SamplingParams { min_p: 1.5, ..d() }), "min_p");
        assert_eq!(err_param(SamplingParams { presence_penalty: 2.5, ..d() }), "presence_penalty");
        assert_eq!(err_param(SamplingParams { frequency_penalty: -3.0, ..d() }), "frequency_penalty");
        assert_eq!(err_param(SamplingParams { repetition_penalty: 0.0, ..d() }), "repetition_penalty");
        assert_eq!(err_param(SamplingParams { max_tokens: Some(0), ..d() }), "max_tokens");
        assert_eq!(err_param(SamplingParams { min_tokens: 20, max_tokens: Some(10), ..d() }), "min_tokens");
        assert_eq!(err_param(SamplingParams { stop: vec![String::new()], ..d() }), "stop");
        assert_eq!(err_param(SamplingParams { logit_bias: vec![(3, 101.0)], ..d() }), "logit_bias");
        assert_eq!(err_param(SamplingParams { logit_bias: vec![(3, f32::NAN)], ..d() }), "logit_bias");
        assert_eq!(err_param(SamplingParams { logprobs: Some(21), ..d() }), "logprobs");
        assert_eq!(err_param(SamplingParams { prompt_logprobs: Some(99), ..d() }), "prompt_logprobs");
        let beam = |w, lp| Some(BeamSearchParams { beam_width: w, length_penalty: lp });
        assert_eq!(err_param(SamplingParams { beam_search: beam(0, 1.0), ..d() }), "beam_width");
        assert_eq!(err_param(SamplingParams { beam_search: beam(2, f32::INFINITY), ..d() }), "length_penalty");
        assert_eq!(err_param(SamplingParams { n: 3, beam_search: beam(2, 1.0), ..d() }), "n");
        assert_eq!(err_param(SamplingParams { temperature: 0.0, n: 1, best_of: Some(2), ..d() }), "best_of");
    }

    #[test]
    fn message_says_what_is_allowed() {
        let e = SamplingParams { top_p: 2.0, ..SamplingParams::default() }.validate().unwrap_err();
        assert_eq!(e.to_string(), "invalid sampling parameter `top_p`: must be in (0, 1], got 2");
    }

    #[test]
    fn sequences_per_request() {
        let d = SamplingParams::default;
        assert_eq!(d().num_sequences(), 1);
        assert_eq!(SamplingParams { n: 2, best_of: Some(4), ..d() }.num_sequences(), 4);
        let beam = Some(BeamSearchParams { beam_width: 4, length_penalty: 1.0 });
        assert_eq!(SamplingParams { beam_search: beam, ..d() }.num_sequences(), 4);
    }
}
