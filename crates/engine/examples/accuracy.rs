//! Where a quantized CPU path's error comes from, measured against the
//! float32 path on the same tokens (which is within 0.00003 nats of the
//! float64 golden references): the shape of llama.cpp's `llama-perplexity
//! --kl-divergence`, so the two engines' figures compare on one text.
//!
//! The text is tokenized once and cut into chunks of `--ctx` tokens (the
//! first replaced by BOS where the model adds one, as llama-perplexity
//! does); each chunk is one prefill, and the positions of its second half
//! are scored. Per scored position, against the float32 path: KL(ref ‖
//! test), whether the most likely token is the same, and the gap of the
//! reference's most likely token's logprob.
//!
//! ```sh
//! cargo run --release -p vellum-engine --example accuracy -- --text FILE \
//!     [--model gemma3-270m] [--ctx 512] [--chunks 8] \
//!     --config default --config 'down16;act=down=int16' --config 'int16;precision=int16'
//! ```
//!
//! A config is `name` then `;`-separated settings: `precision=int8|int16|
//! float32` (default int8), `act=ROLE=BITS,...` (`VELLUM_CPU_ACT`: roles
//! `q k v o gate up down head`, bits `int8 halves int16`), `layers=0-3,7`
//! (`VELLUM_CPU_ACT_LAYERS`), `kv=f16|f32` (default: the engine's auto),
//! `outliers=off` (no calibration pass: plain int8 without outlier channels).

use std::time::Instant;

use vellum_base::{ForwardBatch, KvCacheDtype, ModelExecutor};
use vellum_engine::{auto_kv_cache_dtype, calibration_token_ids, make_executor, CpuOptions, CpuPrecision, Device, ExecutorOptions};
use vellum_models::{resolve_model, RunnerOptions};

struct Config {
    name: String,
    precision: CpuPrecision,
    act: Option<String>,
    layers: Option<String>,
    kv: Option<KvCacheDtype>,
    calibrate: bool,
}

fn parse_config(s: &str) -> Config {
    let mut parts = s.split(';');
    let mut c = Config {
        name: parts.next().unwrap_or("?").to_string(),
        precision: CpuPrecision::Int8,
        act: None,
        layers: None,
        kv: None,
        calibrate: true,
    };
    for p in parts {
        let (k, v) = p.split_once('=').unwrap_or_else(|| panic!("config setting {p:?}: expected key=value"));
        match k {
            "precision" => c.precision = v.parse().unwrap_or_else(|e| panic!("{e}")),
            "act" => c.act = Some(v.to_string()),
            "layers" => c.layers = Some(v.to_string()),
            "outliers" => c.calibrate = v != "off",
            "kv" => {
                c.kv = Some(match v {
                    "f16" => KvCacheDtype::F16,
                    "f32" => KvCacheDtype::F32,
                    "bf16" => KvCacheDtype::Bf16,
                    "fp8" => KvCacheDtype::Fp8E4m3,
                    _ => panic!("kv={v}: f16, bf16, fp8 or f32"),
                })
            }
            _ => panic!("unknown config setting {k:?}"),
        }
    }
    c
}

/// Per-config sums over scored positions.
#[derive(Default)]
struct Stats {
    n: usize,
    kl: f64,
    kls: Vec<f64>,
    same_top: usize,
    gap: f64,
    gap_max: f64,
    nll: f64,
}

fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let lse = row.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln() + max;
    row.iter().map(|&x| x as f64 - lse).collect()
}

fn argmax(v: &[f64]) -> usize {
    v.iter().enumerate().fold((0, f64::NEG_INFINITY), |(bi, bv), (i, &x)| if x > bv { (i, x) } else { (bi, bv) }).0
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mut model, mut text, mut ctx, mut max_chunks, mut configs) = (None, None, 512usize, usize::MAX, Vec::new());
    let mut i = 0;
    while i < args.len() {
        let v = args.get(i + 1).cloned().unwrap_or_default();
        match args[i].as_str() {
            "--model" => model = Some(v),
            "--text" => text = Some(v),
            "--ctx" => ctx = v.parse().expect("--ctx N"),
            "--chunks" => max_chunks = v.parse().expect("--chunks N"),
            "--config" => configs.push(parse_config(&v)),
            other => panic!("unknown argument {other:?}"),
        }
        i += 2;
    }
    let text = std::fs::read_to_string(text.expect("--text FILE")).expect("reading --text");
    if configs.is_empty() {
        configs.push(parse_config("default"));
    }
    let source = resolve_model(model.as_deref()).expect("model");
    let loaded = vellum_models::LoadedModel::open(&source).expect("model loads");
    let vocab = loaded.config.vocab_size;
    let tokens = loaded.tokenizer.encode(&text, false).expect("tokenizes");
    let bos = loaded.tokenizer.encode("", true).expect("tokenizes").first().copied();
    let n_chunks = (tokens.len() / ctx).min(max_chunks);
    assert!(n_chunks > 0, "the text has {} tokens, fewer than --ctx {ctx}", tokens.len());
    eprintln!("{} tokens, {n_chunks} chunks of {ctx}, vocabulary {vocab}", tokens.len());

    let block_size = 16;
    let num_blocks = ctx.div_ceil(block_size) + 1;
    let load = |precision: CpuPrecision, kv: Option<KvCacheDtype>, calibrate: bool| -> Box<dyn ModelExecutor + Send> {
        let dtype = kv.unwrap_or_else(|| auto_kv_cache_dtype(Device::Cpu, precision, vellum_engine::ComputeDtype::Auto));
        let options = ExecutorOptions {
            runner: RunnerOptions { kv_cache_dtype: dtype, hybrid_kv_cache: false, block_size },
            cpu: CpuOptions { precision },
            ..ExecutorOptions::default()
        };
        let mut ex = make_executor(Device::Cpu, &*loaded.weights, loaded.config.clone(), options, |_, _| {}).expect("loads");
        // As the engine does before serving (the int8 path's outlier channels).
        if calibrate {
            ex.calibrate(&calibration_token_ids(&loaded.tokenizer, loaded.chat_template.as_ref())).expect("calibrates");
        }
        ex.initialize_kv_cache(num_blocks, 0, block_size).expect("KV cache");
        ex
    };
    let mut reference = load(CpuPrecision::Float32, Some(KvCacheDtype::F32), false);
    let mut tests: Vec<Box<dyn ModelExecutor + Send>> = configs
        .iter()
        .map(|c| {
            // Weights read the switches when they load; nothing else reads
            // the environment meanwhile (rayon's workers are idle).
            std::env::remove_var("VELLUM_CPU_ACT");
            std::env::remove_var("VELLUM_CPU_ACT_LAYERS");
            if let Some(a) = &c.act {
                std::env::set_var("VELLUM_CPU_ACT", a);
            }
            if let Some(l) = &c.layers {
                std::env::set_var("VELLUM_CPU_ACT_LAYERS", l);
            }
            load(c.precision, c.kv, c.calibrate)
        })
        .collect();
    let mut stats: Vec<Stats> = configs.iter().map(|_| Stats::default()).collect();
    let mut ref_nll = 0.0;
    let first = ctx / 2;
    let started = Instant::now();
    for chunk in 0..n_chunks {
        let mut ids = tokens[chunk * ctx..(chunk + 1) * ctx].to_vec();
        if let Some(b) = bos {
            ids[0] = b;
        }
        let batch = ForwardBatch {
            token_ids: ids.clone(),
            positions: (0..ctx as u32).collect(),
            slot_mapping: (0..ctx as u32).collect(),
            query_start_loc: vec![0, ctx as u32],
            context_lens: vec![ctx as u32],
            block_tables: (0..num_blocks as u32).collect(),
            block_table_stride: num_blocks,
            num_kv_groups: 1,
            logits_indices: (first as u32..ctx as u32 - 1).collect(),
            ..ForwardBatch::default()
        };
        let r = reference.execute(&batch).expect("reference runs").logits;
        let outs: Vec<Vec<f32>> = tests.iter_mut().map(|t| t.execute(&batch).expect("runs").logits).collect();
        for (row, pos) in (first..ctx - 1).enumerate() {
            let lr = log_softmax(&r[row * vocab..(row + 1) * vocab]);
            let top = argmax(&lr);
            let next = ids[pos + 1] as usize;
            ref_nll -= lr[next];
            for (s, o) in stats.iter_mut().zip(&outs) {
                let lt = log_softmax(&o[row * vocab..(row + 1) * vocab]);
                let kl: f64 = lr.iter().zip(&lt).map(|(&a, &b)| a.exp() * (a - b)).sum();
                s.n += 1;
                s.kl += kl;
                s.kls.push(kl);
                s.same_top += usize::from(argmax(&lt) == top);
                let gap = (lt[top] - lr[top]).abs();
                s.gap += gap;
                s.gap_max = s.gap_max.max(gap);
                s.nll -= lt[next];
            }
        }
        eprintln!("chunk {}/{n_chunks} ({:.0} s)", chunk + 1, started.elapsed().as_secs_f64());
    }
    let n = stats.first().map_or(1, |s| s.n.max(1)) as f64;
    println!("reference (float32): {} positions, perplexity {:.4}", n, (ref_nll / n).exp());
    println!("| config | mean KL | p99 KL | same top token | mean gap of ref top | largest gap | perplexity |");
    println!("|---|---|---|---|---|---|---|");
    for (c, s) in configs.iter().zip(&mut stats) {
        s.kls.sort_by(f64::total_cmp);
        let p99 = s.kls[((s.kls.len() as f64 * 0.99) as usize).min(s.kls.len() - 1)];
        let n = s.n as f64;
        println!(
            "| {} | {:.5} | {:.4} | {:.2}% | {:.4} | {:.3} | {:.4} |",
            c.name,
            s.kl / n,
            p99,
            100.0 * s.same_top as f64 / n,
            s.gap / n,
            s.gap_max,
            (s.nll / n).exp()
        );
    }
}
