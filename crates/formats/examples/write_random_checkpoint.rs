//! Writes a random-weight checkpoint of a real shape, for benchmarks on
//! machines that cannot download weights: a Hugging Face directory, or with
//! `--format gguf` one GGUF file that Vellum and llama.cpp both load:
//!
//! ```text
//! cargo run --release -p vellum-formats --example write_random_checkpoint -- \
//!     --shape llama3-8b --dtype bf16 --out /tmp/llama3-8b-random [--seed 1] [--shard-gb 5]
//! cargo run --release -p vellum-formats --example write_random_checkpoint -- \
//!     --shape llama3-8b --format gguf --dtype q8_0 --out /tmp/llama3-8b-q8_0.gguf
//! ```
//!
//! `vellum bench latency --model /tmp/llama3-8b-random` then runs it.

use std::path::PathBuf;
use std::time::Instant;
use vellum_formats::{write_random_checkpoint, write_random_gguf, CheckpointDtype, CheckpointShape, GgufWeightType};

const USAGE: &str =
    "usage: write_random_checkpoint --shape llama3-8b|llama3-1b|smollm2-135m|gemma3-270m-sized|tiny --out PATH [--format hf|gguf] \
                     [--dtype bf16|f16|f32 (hf) | q8_0|q4_1|bf16 (gguf)] [--seed N] [--shard-gb G]";

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}\n{USAGE}");
        std::process::exit(2);
    }
}

fn run() -> Result<(), String> {
    let (mut shape, mut out, mut dtype, mut seed, mut shard_gb) = (None, None, None::<String>, 1u64, 5.0f64);
    let mut gguf = false;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--shape" => {
                let v = value()?;
                shape = Some(CheckpointShape::named(&v).ok_or_else(|| format!("unknown shape {v:?}"))?);
            }
            "--out" => out = Some(PathBuf::from(value()?)),
            "--dtype" => dtype = Some(value()?),
            "--format" => {
                gguf = match value()?.as_str() {
                    "gguf" => true,
                    "hf" => false,
                    other => return Err(format!("unknown format {other:?}")),
                }
            }
            "--seed" => seed = value()?.parse().map_err(|e| format!("--seed: {e}"))?,
            "--shard-gb" => shard_gb = value()?.parse().map_err(|e| format!("--shard-gb: {e}"))?,
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(());
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    let shape = shape.ok_or("--shape is required")?;
    let out = out.ok_or("--out is required")?;
    if shard_gb.is_nan() || shard_gb <= 0.0 {
        return Err("--shard-gb must be positive".into());
    }
    let started = Instant::now();
    let mut last = 0u64;
    let progress = |done: u64, total: u64| {
        // A line per tenth written.
        if done * 10 / total.max(1) != last * 10 / total.max(1) || done == total {
            eprintln!("  {:5.1}% of {:.2} GB", 100.0 * done as f64 / total as f64, total as f64 / 1e9);
        }
        last = done;
    };
    let (report, dtype) = if gguf {
        let v = dtype.unwrap_or_else(|| "q8_0".into());
        let ty = GgufWeightType::parse(&v).ok_or_else(|| format!("unknown GGUF type {v:?}"))?;
        (write_random_gguf(&out, &shape, ty, seed, progress).map_err(|e| e.to_string())?, format!("{ty:?}"))
    } else {
        let v = dtype.unwrap_or_else(|| "bf16".into());
        let dt = CheckpointDtype::parse(&v).ok_or_else(|| format!("unknown dtype {v:?}"))?;
        (write_random_checkpoint(&out, &shape, dt, seed, (shard_gb * 1e9) as u64, progress).map_err(|e| e.to_string())?, format!("{dt:?}"))
    };
    let secs = started.elapsed().as_secs_f64();
    println!(
        "wrote {} ({:.2} B parameters, {}): {} tensors in {} shards, {:.2} GB in {secs:.1} s ({:.2} GB/s)",
        out.display(),
        shape.parameters() as f64 / 1e9,
        dtype,
        report.tensors,
        report.shards,
        report.weight_bytes as f64 / 1e9,
        report.weight_bytes as f64 / 1e9 / secs
    );
    Ok(())
}
