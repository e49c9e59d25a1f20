//! `vellum chat`: an interactive conversation in the terminal, streamed token
//! by token through the model's chat template.

use anyhow::{anyhow, Result};
use clap::Args;
use std::io::{BufRead, Write};
use vellum_core::{SamplingParams, SchedulerConfig};
use vellum_engine::EngineArgs;
use vellum_models::ChatMessage;

/// Arguments of `vellum chat`.
#[derive(Args, Debug)]
pub struct ChatArgs {
    /// Model (default: SmolLM2-135M-Instruct Q4_1).
    #[arg(long)]
    pub model: Option<String>,
    /// A system message to start the conversation with.
    #[arg(long)]
    pub system: Option<String>,
    /// Most tokens per reply.
    #[arg(long, default_value_t = 512)]
    pub max_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.7)]
    pub temperature: f32,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 0.9)]
    pub top_p: f32,
    /// Seed of the generator.
    #[arg(long)]
    pub seed: Option<u64>,
    /// KV cache size (e.g. 1GiB, or a fraction of available memory).
    #[arg(long, default_value = "1GiB")]
    pub kv_cache_memory: String,
}

/// Runs `vellum chat`: one line of input is one user turn; an empty line or
/// end of input quits.
pub fn run(args: ChatArgs) -> Result<()> {
    let engine_args = EngineArgs {
        model: args.model.clone(),
        kv_cache: super::parse_kv_cache_memory(&args.kv_cache_memory)?,
        scheduler: SchedulerConfig { max_model_len: 8192, ..SchedulerConfig::default() },
        ..EngineArgs::default()
    };
    let mut llm = super::load_with_progress(engine_args)?;
    let params = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        seed: args.seed,
        max_tokens: Some(args.max_tokens),
        ..SamplingParams::default()
    };
    params.validate().map_err(|e| anyhow!("{e}"))?;
    let mut messages: Vec<ChatMessage> = args.system.iter().map(|s| ChatMessage::new("system", s.as_str())).collect();
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    eprintln!("(an empty line quits)");
    loop {
        write!(out, "> ")?;
        out.flush()?;
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 || line.trim().is_empty() {
            return Ok(());
        }
        messages.push(ChatMessage::new("user", line.trim_end()));
        let prompt = llm.render_chat(&messages).map_err(|e| anyhow!("{e}"))?;
        let ids = llm.tokenizer().encode(&prompt, true).map_err(|e| anyhow!("{e}"))?;
        let id = llm.engine().add_request(ids, params.clone()).map_err(|e| anyhow!("{e}"))?;
        // Stream: print the decoded text as it grows, never half a character.
        let mut printed = 0;
        let mut reply = String::new();
        while llm.engine().has_unfinished_requests() {
            let finished = llm.engine().step().map_err(|e| anyhow!("{e}"))?;
            let tokens = match llm.engine().output_token_ids(id) {
                Some(t) => t.to_vec(),
                None => finished.iter().find(|r| r.request_id == id).map(|r| r.outputs[0].token_ids.clone()).unwrap_or_default(),
            };
            let text = llm.tokenizer().decode(&tokens, true).map_err(|e| anyhow!("{e}"))?;
            if text.len() > printed && !text.ends_with('\u{FFFD}') {
                write!(out, "{}", &text[printed..])?;
                out.flush()?;
                printed = text.len();
            }
            reply = text;
        }
        writeln!(out)?;
        messages.push(ChatMessage::new("assistant", reply.as_str()));
    }
}
