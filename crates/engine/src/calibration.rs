//! The fixed text a backend calibrates on before serving
//! ([`vellum_base::ModelExecutor::calibrate`]): the CPU's int8 path picks
//! each linear layer's outlier channels from the activations it produces.
//!
//! The text is short (a forward pass of ~200 tokens at startup) and mixes
//! what a model meets: a chat turn in the model's own template, prose,
//! code, numbers, markup and non-Latin scripts. Outlier channels are a
//! property of the model, not of the input, so any such text finds the
//! same ones: calibrated on this text, the int8 path's KL divergence to
//! the float32 path on unrelated text is within a few percent of what
//! calibrating on that text itself gives (docs/benchmarks.md). It is fixed,
//! so the same model gives the same outputs on every start.

use vellum_models::{ChatMessage, ChatTemplate, Tokenizer};

/// The user's turn of the calibration chat.
const QUESTION: &str =
    "Explain, in two sentences, why the sky is blue. Then list three prime numbers and write a Python function that adds two numbers.";

/// Text after the chat: an answer, code, numbers, markup, other scripts.
const TEXT: &str = "Sunlight is scattered by the molecules of the air, and blue light, with its shorter wavelength, \
is scattered far more than red. Three primes: 2, 3 and 5.\n\n```python\ndef add(a, b):\n    return a + b\n```\n\
In 1969, Apollo 11 landed on the Moon; Paris, Berlin and Tokyo are capitals. Ça va? Größe, naïve café — \
東京 🚀 { \"key\": [1, 2.5, -3e10] } <b>bold</b>\n";

/// The calibration tokens for a model: its chat template around
/// [`QUESTION`] (where it has one), then [`TEXT`].
pub fn calibration_token_ids(tokenizer: &Tokenizer, chat_template: Option<&ChatTemplate>) -> Vec<u32> {
    let chat =
        chat_template.and_then(|t| t.render(&[ChatMessage::new("user", QUESTION)], true).ok()).unwrap_or_else(|| format!("{QUESTION}\n"));
    let text = format!("{chat}{TEXT}");
    tokenizer.encode(&text, true).unwrap_or_default()
}
