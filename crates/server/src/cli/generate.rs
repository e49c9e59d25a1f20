//! `vellum generate`: batched offline generation, optionally as JSON lines.
//!
//! With `--json` it prints one object per prompt per line:
//! `{"prompt", "prompt_token_ids", "outputs": [{"index", "text", "token_ids",
//! "logprobs", "cumulative_logprob", "finish_reason"}]}`.

use super::engine_flags::{EngineDefaults, EngineFlags};
use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use serde_json::json;
use std::path::PathBuf;
use vellum_base::{BeamSearchParams, SamplingParams, StructuredOutput};
use vellum_models::ChatMessage;

/// Arguments of `vellum generate`.
#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// A .gguf file, a Hugging Face directory, a hub id in the local cache,
    /// or a short name fetched on first use: smollm2-135m (the default),
    /// gemma3-270m.
    #[arg(long)]
    pub model: Option<String>,
    /// A prompt (repeatable).
    #[arg(long = "prompt", conflicts_with = "prompts_file")]
    pub prompts: Vec<String>,
    /// A JSON file holding a list of prompt strings.
    #[arg(long)]
    pub prompts_file: Option<PathBuf>,
    /// Wrap each prompt as a user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Most tokens to generate per output.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Keep the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: i32,
    /// Drop tokens below this fraction of the top probability.
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Penalty on tokens already in the prompt or output (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// Penalty per occurrence of a token in the output.
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// Penalty once a token is in the output.
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    /// Seed of each request's generator.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Outputs per prompt.
    #[arg(long, default_value_t = 1)]
    pub n: usize,
    /// Beam search with this many candidates (returns the best `--n`).
    #[arg(long)]
    pub beam_width: Option<usize>,
    /// Beam search's length normalisation exponent (score = logprob / len^p).
    #[arg(long, default_value_t = 1.0)]
    pub length_penalty: f32,
    /// Top log-probabilities returned per generated token.
    #[arg(long)]
    pub logprobs: Option<usize>,
    /// Top log-probabilities returned per prompt token (adds a
    /// "prompt_logprobs" key to the JSON).
    #[arg(long)]
    pub prompt_logprobs: Option<usize>,
    /// Stop strings (repeatable); the output is cut before the first one.
    #[arg(long = "stop")]
    pub stop: Vec<String>,
    /// Print JSON lines.
    #[arg(long)]
    pub json: bool,
    /// Constrain the output to JSON valid under this JSON Schema (the
    /// schema itself, or @FILE).
    #[arg(long, value_name = "SCHEMA|@FILE", conflicts_with_all = ["json_object", "regex", "choice", "grammar"])]
    pub json_schema: Option<String>,
    /// Constrain the output to any JSON object.
    #[arg(long, conflicts_with_all = ["regex", "choice", "grammar"])]
    pub json_object: bool,
    /// Constrain the output to text matching this regular expression.
    #[arg(long, conflicts_with_all = ["choice", "grammar"])]
    pub regex: Option<String>,
    /// Constrain the output to one of these strings (repeatable).
    #[arg(long, conflicts_with = "grammar")]
    pub choice: Vec<String>,
    /// Constrain the output to a Lark grammar (llguidance's syntax; the
    /// grammar itself, or @FILE).
    #[arg(long, value_name = "GRAMMAR|@FILE")]
    pub grammar: Option<String>,
    #[command(flatten)]
    pub engine: EngineFlags,
}

/// `TEXT` as given, or the contents of `FILE` for `@FILE`.
fn text_or_file(v: &str) -> Result<String> {
    match v.strip_prefix('@') {
        Some(path) => std::fs::read_to_string(path).with_context(|| format!("reading {path}")),
        None => Ok(v.to_string()),
    }
}

/// The structured-output constraint the flags ask for, if any.
fn structured_output(args: &GenerateArgs) -> Result<Option<StructuredOutput>> {
    Ok(if let Some(s) = &args.json_schema {
        Some(StructuredOutput::Json(text_or_file(s)?))
    } else if args.json_object {
        Some(StructuredOutput::JsonObject)
    } else if let Some(r) = &args.regex {
        Some(StructuredOutput::Regex(r.clone()))
    } else if !args.choice.is_empty() {
        Some(StructuredOutput::Choice(args.choice.clone()))
    } else if let Some(g) = &args.grammar {
        Some(StructuredOutput::Grammar(text_or_file(g)?))
    } else {
        None
    })
}

/// Runs `vellum generate`.
pub fn run(args: GenerateArgs) -> Result<()> {
    let prompts: Vec<String> = match &args.prompts_file {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            serde_json::from_str(&text).with_context(|| format!("{} must hold a JSON list of strings", path.display()))?
        }
        None => args.prompts.clone(),
    };
    if prompts.is_empty() {
        bail!("give at least one --prompt or a --prompts-file");
    }
    let params = SamplingParams {
        n: args.n,
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        frequency_penalty: args.frequency_penalty,
        presence_penalty: args.presence_penalty,
        seed: args.seed,
        max_tokens: Some(args.max_tokens),
        logprobs: args.logprobs,
        prompt_logprobs: args.prompt_logprobs,
        stop: args.stop.clone(),
        beam_search: args.beam_width.map(|beam_width| BeamSearchParams { beam_width, length_penalty: args.length_penalty }),
        structured_output: structured_output(&args)?,
        ..SamplingParams::default()
    };
    params.validate().map_err(|e| anyhow!("{e}"))?;
    tracing::info!(model = args.model.as_deref().unwrap_or("default (SmolLM2-135M-Instruct Q4_1)"), "loading model");
    // Sized for this job: its sequences run at once, and the KV cache holds
    // what they can use (not a server's 256 at the model's full context).
    let samples = args.n.max(args.beam_width.map_or(1, |w| 2 * w));
    let defaults = EngineDefaults { max_num_seqs: (prompts.len() * samples).clamp(1, 256), ..EngineDefaults::default() };
    let engine_args = args.engine.engine_args(args.model.clone(), defaults)?;
    let mut llm = super::load_with_progress(engine_args)?;
    let texts: Vec<String> = if args.chat {
        prompts
            .iter()
            .map(|p| llm.render_chat(&[ChatMessage::new("user", p.as_str())]))
            .collect::<Result<_, _>>()
            .map_err(|e| anyhow!("{e}"))?
    } else {
        prompts.clone()
    };
    let ids = texts.iter().map(|t| llm.tokenizer().encode(t, true)).collect::<Result<Vec<_>, _>>().map_err(|e| anyhow!("{e}"))?;
    let started = std::time::Instant::now();
    let outs = llm.generate_ids(&ids, &params).map_err(|e| anyhow!("{e}"))?;
    let elapsed = started.elapsed().as_secs_f64();
    let mut generated = 0;
    for (prompt, out) in prompts.iter().zip(&outs) {
        let mut outputs = Vec::new();
        for o in &out.outputs {
            generated += o.token_ids.len();
            outputs.push(json!({
                "index": o.index,
                "text": o.text,
                "token_ids": o.token_ids,
                "logprobs": args.logprobs.map(|_| o.logprobs.iter().map(|pos| pos.iter().map(|(t, lp)| json!([t, lp])).collect::<Vec<_>>()).collect::<Vec<_>>()),
                "cumulative_logprob": o.cumulative_logprob,
                "finish_reason": o.finish_reason.map_or("length", |r| r.as_str()),
            }));
        }
        let mut line = json!({ "prompt": prompt, "prompt_token_ids": out.prompt_token_ids, "outputs": outputs });
        if let Some(pl) = &out.prompt_logprobs {
            line["prompt_logprobs"] = pl
                .iter()
                .map(|p| p.as_ref().map(|p| json!({"token_id": p.token_id, "logprob": p.logprob, "top": p.top.iter().map(|(t, lp)| json!([t, lp])).collect::<Vec<_>>()})))
                .collect();
        }
        if args.json {
            println!("{line}");
        } else {
            println!("=== {prompt:?}");
            for o in &outputs {
                println!("--- [{}] {}", o["finish_reason"].as_str().unwrap_or(""), o["text"].as_str().unwrap_or(""));
            }
        }
    }
    let kv = llm.kv_sharing();
    tracing::info!(
        peak_used_blocks = kv.peak_used_blocks,
        logical_blocks_at_peak = kv.logical_blocks_at_peak,
        saved_by_sharing = format!("{:.1}%", 100.0 * kv.saved_fraction_at_peak()),
        "KV blocks (physical vs. what the block tables reference)"
    );
    let c = llm.engine().counters();
    tracing::info!(
        prompts = prompts.len(),
        generated,
        elapsed_s = format!("{elapsed:.2}"),
        tokens_per_s = format!("{:.1}", generated as f64 / elapsed),
        steps = c.num_steps,
        execute_s = format!("{:.2}", c.execute_s),
        sample_s = format!("{:.2}", c.sample_s),
        structured_mask_s = format!("{:.3}", c.structured_mask_s),
        "done"
    );
    let sd = llm.engine().spec_decode_counters();
    if sd.num_drafts > 0 {
        tracing::info!(
            drafts = sd.num_drafts,
            draft_tokens = sd.num_draft_tokens,
            accepted_tokens = sd.num_accepted_tokens,
            acceptance_rate = format!("{:.1}%", 100.0 * sd.acceptance_rate()),
            mean_acceptance_length = format!("{:.2}", sd.mean_acceptance_length()),
            "speculative decoding"
        );
    }
    Ok(())
}
