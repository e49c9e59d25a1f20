//! `vellum chat`: an interactive conversation in the terminal, streamed token
//! by token through the model's chat template.

use super::engine_flags::{EngineDefaults, EngineFlags};
use anyhow::{anyhow, Result};
use clap::Args;
use std::io::{BufRead, Write};
use vellum_base::SamplingParams;
use vellum_models::ChatMessage;

/// Arguments of `vellum chat`.
#[derive(Args, Debug)]
pub struct ChatArgs {
    /// Model: a .gguf file, a Hugging Face directory, or a short name
    /// (smollm2-135m, the default; gemma3-270m).
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
    /// Stop strings (repeatable): a reply ends before the first one.
    #[arg(long = "stop")]
    pub stop: Vec<String>,
    #[command(flatten)]
    pub engine: EngineFlags,
}

/// Runs `vellum chat`: one line of input is one user turn; an empty line or
/// end of input quits.
pub fn run(args: ChatArgs) -> Result<()> {
    // One conversation: the KV cache is sized for one sequence.
    let engine_args = args.engine.engine_args(args.model.clone(), EngineDefaults { max_num_seqs: 1, ..EngineDefaults::default() })?;
    let mut llm = super::load_with_progress(engine_args)?;
    let params = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        seed: args.seed,
        max_tokens: Some(args.max_tokens),
        stop: args.stop.clone(),
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
        // The template writes the special tokens.
        let ids = llm.tokenizer().encode(&prompt, false).map_err(|e| anyhow!("{e}"))?;
        // Streamed through the engine's output path: text appears as it is
        // generated, never half a character, cut at a stop string.
        let outs = llm
            .generate_ids_streaming(&[ids], &params, |piece| {
                let _ = write!(out, "{}", piece.text);
                let _ = out.flush();
            })
            .map_err(|e| anyhow!("{e}"))?;
        let reply = outs.first().and_then(|o| o.outputs.first()).map(|o| o.text.clone()).unwrap_or_default();
        writeln!(out)?;
        messages.push(ChatMessage::new("assistant", reply.as_str()));
    }
}
