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
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Simulate(args) => cli::simulate::run(args),
    }
}
