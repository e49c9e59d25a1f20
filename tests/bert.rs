//! Encoder embedding models: a tiny random-weight BERT
//! (`vellum_formats::write_random_bert`, re-exported by `vellum-models`: a `BertModel` Hugging Face
//! directory with safetensors, config.json, a WordPiece tokenizer.json with
//! `[CLS] … [SEP]`, and sentence-transformers pooling files), loaded by the
//! engine with `--task auto` (an encoder: embeddings), pooled CLS (the
//! default) and MEAN, against a float64 forward pass written here from
//! Hugging Face's `BertModel` (post-norm LayerNorm, learned positions plus
//! token type 0, bidirectional attention, exact GELU).

use std::path::{Path, PathBuf};
use vellum::core::{BlockAllocator, PoolingType};
use vellum::engine::{CpuPrecision, EngineArgs, Llm, PoolerConfig, Task};
use vellum::models::{write_random_bert, BertOptions, BertShape, SafetensorsWeights, WeightSource};

const SHAPE: BertShape = BertShape { hidden: 32, intermediate: 64, layers: 2, heads: 4, max_positions: 48 };
const EPS: f64 = 1e-12;

/// Every token's final hidden state, in float64 from the checkpoint's own
/// tensors (`prefix`: `bert.` or none).
fn reference(dir: &Path, prefix: &str, ids: &[u32]) -> Vec<Vec<f64>> {
    let weights = SafetensorsWeights::open(dir).expect("opens");
    let w = |name: &str| -> Vec<f64> {
        let name = format!("{prefix}{name}");
        weights.tensor_f32(&name).unwrap_or_else(|e| panic!("{name}: {e}")).data.iter().map(|&x| x as f64).collect()
    };
    let h = SHAPE.hidden;
    let layer_norm = |x: &[f64], g: &[f64], b: &[f64]| -> Vec<f64> {
        let n = x.len() as f64;
        let mean = x.iter().sum::<f64>() / n;
        let var = x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
        x.iter().zip(g).zip(b).map(|((v, g), b)| (v - mean) / (var + EPS).sqrt() * g + b).collect()
    };
    // y = W x + b, W [out, in]
    let linear = |x: &[f64], wt: &[f64], b: &[f64]| -> Vec<f64> {
        b.iter()
            .enumerate()
            .map(|(o, bo)| bo + x.iter().zip(&wt[o * x.len()..(o + 1) * x.len()]).map(|(a, c)| a * c).sum::<f64>())
            .collect()
    };
    let gelu = |x: f64| 0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2));
    let (we, pe, te) =
        (w("embeddings.word_embeddings.weight"), w("embeddings.position_embeddings.weight"), w("embeddings.token_type_embeddings.weight"));
    let (eg, eb) = (w("embeddings.LayerNorm.weight"), w("embeddings.LayerNorm.bias"));
    let mut states: Vec<Vec<f64>> = ids
        .iter()
        .enumerate()
        .map(|(p, &id)| {
            let x: Vec<f64> = (0..h).map(|j| we[id as usize * h + j] + pe[p * h + j] + te[j]).collect();
            layer_norm(&x, &eg, &eb)
        })
        .collect();
    let hd = h / SHAPE.heads;
    for l in 0..SHAPE.layers {
        let p = |s: &str| format!("encoder.layer.{l}.{s}");
        let lin = |x: &[f64], name: &str| linear(x, &w(&p(&format!("{name}.weight"))), &w(&p(&format!("{name}.bias"))));
        let q: Vec<Vec<f64>> = states.iter().map(|x| lin(x, "attention.self.query")).collect();
        let k: Vec<Vec<f64>> = states.iter().map(|x| lin(x, "attention.self.key")).collect();
        let v: Vec<Vec<f64>> = states.iter().map(|x| lin(x, "attention.self.value")).collect();
        let mut ctx = vec![vec![0f64; h]; ids.len()];
        for head in 0..SHAPE.heads {
            let r = head * hd..(head + 1) * hd;
            for i in 0..ids.len() {
                // Bidirectional: every key of the sequence.
                let scores: Vec<f64> = (0..ids.len())
                    .map(|j| q[i][r.clone()].iter().zip(&k[j][r.clone()]).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt())
                    .collect();
                let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (j, ej) in e.iter().enumerate() {
                    for (c, d) in r.clone().enumerate() {
                        ctx[i][r.start + c] += ej / z * v[j][d];
                    }
                }
            }
        }
        states = states
            .iter()
            .zip(&ctx)
            .map(|(x, c)| {
                let a: Vec<f64> = lin(c, "attention.output.dense").iter().zip(x).map(|(o, x)| o + x).collect();
                let a = layer_norm(&a, &w(&p("attention.output.LayerNorm.weight")), &w(&p("attention.output.LayerNorm.bias")));
                let up: Vec<f64> = lin(&a, "intermediate.dense").into_iter().map(gelu).collect();
                let o: Vec<f64> = lin(&up, "output.dense").iter().zip(&a).map(|(o, a)| o + a).collect();
                layer_norm(&o, &w(&p("output.LayerNorm.weight")), &w(&p("output.LayerNorm.bias")))
            })
            .collect();
    }
    states
}

/// erf by its Taylor series (|x| below 6 here), else ±1.
fn erf(x: f64) -> f64 {
    if x.abs() > 6.0 {
        return x.signum();
    }
    let (mut term, mut sum) = (x, x);
    for n in 1..200 {
        term *= -x * x / n as f64;
        sum += term / (2 * n + 1) as f64;
    }
    sum * std::f64::consts::FRAC_2_SQRT_PI
}

fn pooled(states: &[Vec<f64>], pooling: PoolingType) -> Vec<f64> {
    let v: Vec<f64> = match pooling {
        PoolingType::Cls => states[0].clone(),
        _ => (0..SHAPE.hidden).map(|j| states.iter().map(|s| s[j]).sum::<f64>() / states.len() as f64).collect(),
    };
    let n = v.iter().map(|x| x * x).sum::<f64>().sqrt();
    v.iter().map(|x| x / n).collect()
}

fn temp_dir(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("vellum-bert-{tag}-{}", std::process::id()))
}

const TEXTS: [&str; 4] = [
    "The cat sat on the mat.",
    "A dog ran far away, the sky blue.",
    "Cats sating",
    // 36 tokens: the bidirectional attention across three blocks of 16.
    "the cat sat on the mat , the dog ran far away , a blue sky , the cat ran , the dog sat on a mat . the sky , the mat .",
];

fn largest_gap(got: &[f32], want: &[f64]) -> f64 {
    got.iter().zip(want).map(|(a, b)| (*a as f64 - b).abs()).fold(0f64, f64::max)
}

#[test]
fn a_bert_encoder_embeds_as_its_float64_reference_with_cls_and_mean_pooling() {
    let dir = temp_dir("ref");
    write_random_bert(&dir, &SHAPE, &BertOptions { seed: 7, prefixed: false, minimal_config: false, pooling: None }).expect("writes");
    let model = Some(dir.to_string_lossy().into_owned());
    for (pooling, name) in [(PoolingType::Cls, "CLS (the default)"), (PoolingType::Mean, "MEAN")] {
        let mut llm = Llm::new(EngineArgs {
            model: model.clone(),
            task: Task::Auto,
            cpu_precision: CpuPrecision::Float32,
            pooler_config: PoolerConfig { pooling_type: (pooling == PoolingType::Mean).then_some(pooling), normalize: None },
            ..EngineArgs::default()
        })
        .expect("a BertModel loads for embeddings");
        let ids: Vec<Vec<u32>> = TEXTS.iter().map(|t| llm.tokenizer().encode(t, true).expect("tokenizes")).collect();
        assert_eq!(ids[0], vec![2, 4, 5, 6, 7, 4, 8, 18, 3], "WordPiece with [CLS] … [SEP], neither padded nor cut");
        assert_eq!(&ids[2][1..5], &[5, 14, 6, 15], "cat ##s sat ##ing");
        assert_eq!(ids[3].len(), 36, "34 words and marks, [CLS] and [SEP]");
        let got = llm.embed(&TEXTS, None).expect("embeds");
        for (i, (g, ids)) in got.iter().zip(&ids).enumerate() {
            let gap = largest_gap(g, &pooled(&reference(&dir, "", ids), pooling));
            eprintln!("{name} text {i}: largest difference to float64 {gap:.2e}");
            assert!(gap < 1e-6, "{name} text {i}: differs from the float64 reference by {gap}");
        }
        // One by one equals batched; a repeated text (no prefix cache for an
        // encoder: its keys depend on the tokens after them) equals the first.
        let alone = llm.embed(&TEXTS[1..2], None).expect("embeds");
        assert_eq!(alone[0], got[1], "{name}: alone = batched");
        let again = llm.embed(&[TEXTS[3], TEXTS[3]], None).expect("embeds");
        assert_eq!(again[0], got[3]);
        assert_eq!(again[1], got[3]);
        assert_eq!(llm.engine().scheduler().allocator().stats().num_used_blocks, 0);
    }
    // The default CPU path (int8 precision: float32 weights stay float32,
    // the KV cache is float16): close to the reference too.
    let mut llm = Llm::new(EngineArgs { model: model.clone(), ..EngineArgs::default() }).expect("loads");
    let got = llm.embed(&TEXTS, None).expect("embeds");
    for (i, (g, text)) in got.iter().zip(TEXTS).enumerate() {
        let ids = llm.tokenizer().encode(text, true).expect("tokenizes");
        let gap = largest_gap(g, &pooled(&reference(&dir, "", &ids), PoolingType::Cls));
        eprintln!("default path text {i}: largest difference to float64 {gap:.2e}");
        assert!(gap < 1e-4, "default path text {i}: {gap}");
    }
    // An encoder has no LM head: generation is refused by name.
    let e =
        Llm::new(EngineArgs { model: model.clone(), task: Task::Generate, ..EngineArgs::default() }).err().expect("refused").to_string();
    assert!(e.contains("--task embed"), "{e}");
    // Bidirectional attention is the CPU backend's: other devices refuse an encoder by name.
    for device in [vellum::engine::Device::Wgpu, vellum::engine::Device::Cuda].into_iter().filter(|d| d.is_compiled()) {
        let e = Llm::new(EngineArgs { model: model.clone(), device, ..EngineArgs::default() }).err().expect("refused").to_string();
        assert!(e.contains("run on --device cpu"), "{device}: {e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A checkpoint as `BertForMaskedLM` files name it (`bert.` prefix), whose
/// config leaves BERT's defaults out (eps 1e-12, GELU, two token types),
/// with sentence-transformers files asking for mean pooling: read as
/// declared.
#[test]
fn prefixed_names_default_config_values_and_declared_pooling_are_read() {
    let dir = temp_dir("prefixed");
    write_random_bert(&dir, &SHAPE, &BertOptions { seed: 11, prefixed: true, minimal_config: true, pooling: Some("mean") })
        .expect("writes");
    let mut llm = Llm::new(EngineArgs {
        model: Some(dir.to_string_lossy().into_owned()),
        cpu_precision: CpuPrecision::Float32,
        ..EngineArgs::default()
    })
    .expect("loads");
    let got = llm.embed(&TEXTS, None).expect("embeds");
    for (i, (g, text)) in got.iter().zip(TEXTS).enumerate() {
        let ids = llm.tokenizer().encode(text, true).expect("tokenizes");
        let gap = largest_gap(g, &pooled(&reference(&dir, "bert.", &ids), PoolingType::Mean));
        assert!(gap < 1e-6, "text {i}: {gap}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
