//! Subcommands of `vellum`, one module each.

pub mod bench;
pub mod bench_latency;
pub mod bench_serve;
pub mod chat;
pub mod generate;
pub mod paper_reproduction;
pub mod plot;
pub mod simulate;

use anyhow::{anyhow, bail, Result};
use indicatif::{ProgressBar, ProgressStyle};
use vellum_core::KvCacheSize;
use vellum_engine::{EngineArgs, Llm};

/// Parses `--kv-cache-memory`: `4GiB`, `512MiB`, `1000000` (bytes) or a
/// fraction of available memory such as `0.5`.
pub fn parse_kv_cache_memory(s: &str) -> Result<KvCacheSize> {
    let t = s.trim();
    if let Ok(f) = t.parse::<f32>() {
        if t.contains('.') || f <= 1.0 {
            if !(f > 0.0 && f <= 1.0) {
                bail!("--kv-cache-memory fraction must be in (0, 1], got {t}");
            }
            return Ok(KvCacheSize::FractionOfFree(f));
        }
    }
    let (num, mult) = [("GiB", 1u64 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("GB", 1_000_000_000), ("MB", 1_000_000), ("B", 1)]
        .iter()
        .find_map(|(suffix, m)| t.strip_suffix(suffix).map(|n| (n.trim(), *m)))
        .unwrap_or((t, 1));
    let n: f64 = num.parse().map_err(|_| anyhow!("--kv-cache-memory: cannot read {s:?} (use e.g. 4GiB, 512MiB or 0.5)"))?;
    if n.is_nan() || n <= 0.0 {
        bail!("--kv-cache-memory must be positive, got {s:?}");
    }
    Ok(KvCacheSize::MemoryBytes((n * mult as f64) as u64))
}

/// Loads the model with a progress bar over its layers.
pub fn load_with_progress(args: EngineArgs) -> Result<Llm> {
    let bar = ProgressBar::new(0);
    bar.set_style(ProgressStyle::with_template("loading weights {bar:30} {pos}/{len} layers").unwrap_or_else(|_| ProgressStyle::default_bar()));
    let llm = Llm::new_with_progress(args, |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })
    .map_err(|e| anyhow!("{e}"))?;
    bar.finish_and_clear();
    Ok(llm)
}

/// `len` random ordinary token ids (above the first 100 ids, where special
/// tokens live), for benchmark prompts.
pub fn random_prompt(rng: &mut vellum_core::SeededRng, vocab_size: usize, len: usize) -> Vec<u32> {
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
