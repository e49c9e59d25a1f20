//! `vellum` — the command line.

#![forbid(unsafe_code)]

use clap::{Parser, Subcommand};

mod cli;
mod serve;

/// Vellum: an LLM inference and serving engine built on PagedAttention.
#[derive(Parser)]
#[command(name = "vellum", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve a model over an OpenAI-compatible HTTP API (like `vllm serve`).
    Serve(serve::ServeArgs),
    /// Replay a synthetic trace through the real scheduler and KV-cache
    /// manager in simulated time (paper §6 memory experiments).
    Simulate(cli::simulate::SimulateArgs),
    /// Generate completions for prompts with a model (offline, batched).
    Generate(cli::generate::GenerateArgs),
    /// Chat with a model in the terminal, streaming its replies.
    Chat(cli::chat::ChatArgs),
    /// Benchmarks: offline throughput, or online serving against any
    /// OpenAI-compatible endpoint.
    #[command(subcommand)]
    Bench(cli::bench::BenchCommand),
}

fn main() -> std::process::ExitCode {
    use std::io::IsTerminal;
    // Colour only on a terminal, and never under NO_COLOR (no-color.org).
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .with_ansi(colour)
        .init();
    let result = match Cli::parse().command {
        Command::Serve(args) => serve::run(args),
        Command::Simulate(args) => cli::simulate::run(args),
        Command::Generate(args) => cli::generate::run(args),
        Command::Bench(cmd) => cli::bench::run(cmd),
        Command::Chat(args) => cli::chat::run(args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // A user's mistake (a missing file, a bad flag value) is one
            // message and its causes, not a backtrace.
            eprintln!("error: {e}");
            for cause in e.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            std::process::ExitCode::FAILURE
        }
    }
}
