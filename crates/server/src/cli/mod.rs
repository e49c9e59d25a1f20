//! Subcommands of `vellum`, one module each.

pub mod bench;
pub mod bench_latency;
pub mod bench_serve;
pub mod chat;
pub mod engine_flags;
pub mod generate;
pub mod paper_reproduction;
pub mod plot;
pub mod simulate;

use anyhow::{anyhow, Result};
use indicatif::{ProgressBar, ProgressStyle};
use vellum_engine::{EngineArgs, Llm};

/// Loads the model with a progress bar over its layers.
pub fn load_with_progress(args: EngineArgs) -> Result<Llm> {
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("loading weights {bar:30} {pos}/{len} layers").unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let llm = Llm::new_with_progress(args, |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
        // Cleared at the last layer, before the engine logs its next
        // lines: a bar cleared after them would erase a log line and leave
        // itself on screen.
        if done == total {
            bar.finish_and_clear();
        }
    });
    bar.finish_and_clear();
    llm.map_err(|e| anyhow!("{e}"))
}

/// `len` random ordinary token ids (above the first 100 ids, where special
/// tokens live), for benchmark prompts.
pub fn random_prompt(rng: &mut vellum_base::SeededRng, vocab_size: usize, len: usize) -> Vec<u32> {
    let span = vocab_size.saturating_sub(100).max(1) as u64;
    (0..len).map(|_| (100 + rng.next_u64() % span) as u32).collect()
}

/// Linear-interpolated percentile of sorted values (numpy's default).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = p / 100.0 * (sorted.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}
