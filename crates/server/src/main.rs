//! `vellum` — the command line.

use clap::{Parser, Subcommand};

mod cli;

/// Vellum: an LLM inference and serving engine built on PagedAttention.
#[derive(Parser)]
#[command(name = "vellum", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Replay a synthetic trace through the real scheduler and KV-cache
    /// manager in simulated time (paper §6 memory experiments).
    Simulate(cli::simulate::SimulateArgs),
    /// Generate completions for prompts with a model (offline, batched).
    Generate(cli::generate::GenerateArgs),
    /// Chat with a model in the terminal, streaming its replies.
    Chat(cli::chat::ChatArgs),
    /// Measure throughput on the local model.
    #[command(subcommand)]
    Bench(cli::bench::BenchCommand),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Simulate(args) => cli::simulate::run(args),
        Command::Generate(args) => cli::generate::run(args),
        Command::Bench(cmd) => cli::bench::run(cmd),
        Command::Chat(args) => cli::chat::run(args),
    }
}
