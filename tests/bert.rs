//! Encoder embedding models: a tiny random-weight BERT (`BertModel`,
//! written by the test as a Hugging Face directory: safetensors, config.json
//! and a WordPiece tokenizer.json with `[CLS] … [SEP]`), loaded by the
//! engine with `--task auto` (a base model: embeddings), pooled CLS (the
//! default) and MEAN, against a float64 forward pass written here from the
//! published architecture (post-norm LayerNorm, learned positions plus token
//! type 0, bidirectional attention, exact GELU).

use safetensors::tensor::{Dtype, TensorView};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use vellum::core::{BlockAllocator, PoolingType};
use vellum::engine::{CpuPrecision, EngineArgs, Llm, PoolerConfig, Task};

const H: usize = 32;
const HEADS: usize = 4;
const LAYERS: usize = 2;
const IM: usize = 64;
const MAX_POS: usize = 40;
const EPS: f64 = 1e-12;
const WORDS: &[&str] = &["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "far", "away", "##s", "##ing", "blue", "sky", ".", ","];

/// Special tokens first, then [`WORDS`].
fn vocab() -> Vec<String> {
    let mut v: Vec<String> = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"].iter().map(|s| s.to_string()).collect();
    v.extend(WORDS.iter().map(|s| s.to_string()));
    v
}

/// Deterministic weights, scaled like an initialized BERT's (N(0, 0.02)-ish,
/// larger here so the layers matter).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.4
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}

type Tensors = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

fn weights() -> Tensors {
    let mut rng = Rng(7);
    let v = vocab().len();
    let mut t = Tensors::new();
    let mut put = |name: &str, shape: Vec<usize>, rng: &mut Rng, bias_like: Option<f32>| {
        let n = shape.iter().product();
        let data = match bias_like {
            Some(center) => rng.vec(n).into_iter().map(|x| center + x * 0.5).collect(),
            None => rng.vec(n),
        };
        t.insert(name.to_string(), (shape, data));
    };
    put("embeddings.word_embeddings.weight", vec![v, H], &mut rng, None);
    put("embeddings.position_embeddings.weight", vec![MAX_POS, H], &mut rng, None);
    put("embeddings.token_type_embeddings.weight", vec![2, H], &mut rng, None);
    put("embeddings.LayerNorm.weight", vec![H], &mut rng, Some(1.0));
    put("embeddings.LayerNorm.bias", vec![H], &mut rng, Some(0.0));
    for l in 0..LAYERS {
        let p = |s: &str| format!("encoder.layer.{l}.{s}");
        for (name, out, inp) in [
            ("attention.self.query", H, H),
            ("attention.self.key", H, H),
            ("attention.self.value", H, H),
            ("attention.output.dense", H, H),
            ("intermediate.dense", IM, H),
            ("output.dense", H, IM),
        ] {
            put(&p(&format!("{name}.weight")), vec![out, inp], &mut rng, None);
            put(&p(&format!("{name}.bias")), vec![out], &mut rng, Some(0.0));
        }
        for norm in ["attention.output.LayerNorm", "output.LayerNorm"] {
            put(&p(&format!("{norm}.weight")), vec![H], &mut rng, Some(1.0));
            put(&p(&format!("{norm}.bias")), vec![H], &mut rng, Some(0.0));
        }
    }
    // The pooler is in BertModel checkpoints; the engine does not read it.
    put("pooler.dense.weight", vec![H, H], &mut rng, None);
    put("pooler.dense.bias", vec![H], &mut rng, Some(0.0));
    t
}

fn write_checkpoint(dir: &Path, tensors: &Tensors) {
    std::fs::create_dir_all(dir).expect("mkdir");
    let bytes: BTreeMap<&String, Vec<u8>> =
        tensors.iter().map(|(k, (_, d))| (k, d.iter().flat_map(|x| x.to_le_bytes()).collect())).collect();
    let views: Vec<(&String, TensorView<'_>)> =
        tensors.iter().map(|(k, (shape, _))| (k, TensorView::new(Dtype::F32, shape.clone(), &bytes[k]).expect("view"))).collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).expect("safetensors");
    let config = serde_json::json!({
        "architectures": ["BertModel"], "model_type": "bert", "vocab_size": vocab().len(), "hidden_size": H,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "intermediate_size": IM, "hidden_act": "gelu",
        "max_position_embeddings": MAX_POS, "type_vocab_size": 2, "layer_norm_eps": EPS, "position_embedding_type": "absolute",
        "pad_token_id": 0
    });
    std::fs::write(dir.join("config.json"), config.to_string()).expect("config");
    let vocab_map: serde_json::Map<String, serde_json::Value> =
        vocab().into_iter().enumerate().map(|(i, w)| (w, serde_json::json!(i))).collect();
    let special = |id: usize, content: &str| serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true});
    let tokenizer = serde_json::json!({
        // As sentence-transformers saves them (all-MiniLM-L6-v2's): a batch
        // setting that must not pad or cut a single prompt.
        "version": "1.0",
        "truncation": {"direction": "Right", "max_length": 6, "strategy": "LongestFirst", "stride": 0},
        "padding": {"strategy": {"Fixed": 16}, "direction": "Right", "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0, "pad_token": "[PAD]"},
        "added_tokens": [special(0, "[PAD]"), special(1, "[UNK]"), special(2, "[CLS]"), special(3, "[SEP]")],
        "normalizer": {"type": "BertNormalizer", "clean_text": true, "handle_chinese_chars": true, "strip_accents": null, "lowercase": true},
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "[SEP]", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "[SEP]", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}, {"SpecialToken": {"id": "[SEP]", "type_id": 1}}],
            "special_tokens": {"[CLS]": {"id": "[CLS]", "ids": [2], "tokens": ["[CLS]"]}, "[SEP]": {"id": "[SEP]", "ids": [3], "tokens": ["[SEP]"]}}},
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##", "max_input_chars_per_word": 100, "vocab": vocab_map}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).expect("tokenizer");
}

/// The float64 forward pass: every token's final hidden state.
fn reference(t: &Tensors, ids: &[u32]) -> Vec<Vec<f64>> {
    let w = |name: &str| -> Vec<f64> { t[name].1.iter().map(|&x| x as f64).collect() };
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
    let mut h: Vec<Vec<f64>> = ids
        .iter()
        .enumerate()
        .map(|(p, &id)| {
            let x: Vec<f64> = (0..H).map(|j| we[id as usize * H + j] + pe[p * H + j] + te[j]).collect();
            layer_norm(&x, &eg, &eb)
        })
        .collect();
    let hd = H / HEADS;
    for l in 0..LAYERS {
        let p = |s: &str| format!("encoder.layer.{l}.{s}");
        let lin = |x: &[f64], name: &str| linear(x, &w(&p(&format!("{name}.weight"))), &w(&p(&format!("{name}.bias"))));
        let q: Vec<Vec<f64>> = h.iter().map(|x| lin(x, "attention.self.query")).collect();
        let k: Vec<Vec<f64>> = h.iter().map(|x| lin(x, "attention.self.key")).collect();
        let v: Vec<Vec<f64>> = h.iter().map(|x| lin(x, "attention.self.value")).collect();
        let mut ctx = vec![vec![0f64; H]; ids.len()];
        for head in 0..HEADS {
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
        h = h
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
    h
}

/// erf by its Taylor series (|x| small here) or 1 beyond 6.
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

fn normalized(v: &[f64]) -> Vec<f64> {
    let n = v.iter().map(|x| x * x).sum::<f64>().sqrt();
    v.iter().map(|x| x / n).collect()
}

fn temp_dir(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("vellum-bert-{tag}-{}", std::process::id()))
}

#[test]
fn a_bert_encoder_embeds_as_its_float64_reference_with_cls_and_mean_pooling() {
    let dir = temp_dir("ref");
    let tensors = weights();
    write_checkpoint(&dir, &tensors);
    let texts = ["The cat sat on the mat.", "A dog ran far away, the sky blue.", "Cats sating"];
    for (pooling, name) in [(None, "CLS (the default)"), (Some(PoolingType::Mean), "MEAN")] {
        let mut llm = Llm::new(EngineArgs {
            model: Some(dir.to_string_lossy().into_owned()),
            task: Task::Auto,
            cpu_precision: CpuPrecision::Float32,
            pooler_config: PoolerConfig { pooling_type: pooling, normalize: None },
            ..EngineArgs::default()
        })
        .expect("a BertModel loads for embeddings");
        let ids: Vec<Vec<u32>> = texts.iter().map(|t| llm.tokenizer().encode(t, true).expect("tokenizes")).collect();
        assert_eq!(ids[0], vec![2, 4, 5, 6, 7, 4, 8, 18, 3], "WordPiece with [CLS] … [SEP], neither padded nor cut");
        assert_eq!(&ids[2][1..5], &[5, 14, 6, 15], "cat ##s sat ##ing");
        let got = llm.embed(&texts, None).expect("embeds");
        for (i, (g, ids)) in got.iter().zip(&ids).enumerate() {
            let states = reference(&tensors, ids);
            let pooled: Vec<f64> = match pooling {
                None => states[0].clone(),
                _ => (0..H).map(|j| states.iter().map(|s| s[j]).sum::<f64>() / states.len() as f64).collect(),
            };
            let want = normalized(&pooled);
            let worst = g.iter().zip(&want).map(|(a, b)| (*a as f64 - b).abs()).fold(0f64, f64::max);
            eprintln!("{name} text {i}: largest difference to float64 {worst:.2e}");
            assert!(worst < 2e-5, "{name} text {i}: differs from the float64 reference by {worst}");
        }
        // One by one equals batched; a repeated text (no prefix cache for an
        // encoder: its keys depend on the tokens after them) equals the first.
        let alone = llm.embed(&texts[1..2], None).expect("embeds");
        assert_eq!(alone[0], got[1], "{name}: alone = batched");
        let again = llm.embed(&[texts[0], texts[0]], None).expect("embeds");
        assert_eq!(again[0], got[0]);
        assert_eq!(again[1], got[0]);
        assert_eq!(llm.engine().scheduler().allocator().stats().num_used_blocks, 0);
    }
    // An encoder has no LM head: generation is refused by name.
    let e = Llm::new(EngineArgs { model: Some(dir.to_string_lossy().into_owned()), task: Task::Generate, ..EngineArgs::default() })
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("--task embed"), "{e}");
    // Bidirectional attention is the CPU backend's: other devices refuse an encoder by name.
    for device in [vellum::engine::Device::Wgpu, vellum::engine::Device::Cuda].into_iter().filter(|d| d.is_compiled()) {
        let e = Llm::new(EngineArgs { model: Some(dir.to_string_lossy().into_owned()), device, ..EngineArgs::default() })
            .err()
            .expect("refused")
            .to_string();
        assert!(e.contains("run on --device cpu"), "{device}: {e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
