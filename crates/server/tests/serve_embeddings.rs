//! `/v1/embeddings` through the official `openai` client against `vellum
//! serve --task embed`, on a tiny random Llama checkpoint the test writes
//! (float32 safetensors, byte-level tokenizer) and whose pooled vectors it
//! computes itself in float64: embedding, RMSNorm, RoPE (rotate-half),
//! grouped-query causal attention, SwiGLU, the final norm, mean pooling and
//! normalization, straight from the Hugging Face definition.

mod common;

use common::{python_with_openai, run_python, Server};
use std::path::Path;
use vellum_formats::{write_random_checkpoint, CheckpointDtype, CheckpointShape, SafetensorsWeights, WeightSource};

const SHAPE: CheckpointShape = CheckpointShape {
    hidden: 64,
    intermediate: 128,
    layers: 2,
    heads: 4,
    kv_heads: 2,
    vocab: 300,
    max_positions: 512,
    rope_theta: 10_000.0,
};

/// A tensor of the checkpoint in float64, row-major.
fn tensor(w: &SafetensorsWeights, name: &str) -> Vec<f64> {
    w.tensor_f32(name).unwrap_or_else(|e| panic!("{name}: {e}")).data.iter().map(|&x| f64::from(x)).collect()
}

/// `y = W x` for `W` of `rows × x.len()`.
fn matvec(w: &[f64], x: &[f64]) -> Vec<f64> {
    w.chunks(x.len()).map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum()).collect()
}

fn rms_norm(x: &[f64], w: &[f64]) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + 1e-5).sqrt();
    x.iter().zip(w).map(|(v, g)| v * r * g).collect()
}

/// Hugging Face's RoPE on one head (`rotate_half`: pairs `i`, `i + d/2`).
fn rope(x: &mut [f64], pos: usize) {
    let d = x.len();
    for i in 0..d / 2 {
        let freq = SHAPE.rope_theta.powf(-((2 * i) as f64) / d as f64);
        let (s, c) = (pos as f64 * freq).sin_cos();
        let (a, b) = (x[i], x[i + d / 2]);
        x[i] = a * c - b * s;
        x[i + d / 2] = b * c + a * s;
    }
}

/// The final-normed hidden state of every position of `ids`.
fn reference_hidden(w: &SafetensorsWeights, ids: &[u32]) -> Vec<Vec<f64>> {
    let (h, hd) = (SHAPE.hidden, SHAPE.hidden / SHAPE.heads);
    let embed = tensor(w, "model.embed_tokens.weight");
    let mut xs: Vec<Vec<f64>> = ids.iter().map(|&t| embed[t as usize * h..(t as usize + 1) * h].to_vec()).collect();
    for l in 0..SHAPE.layers {
        let p = |s: &str| tensor(w, &format!("model.layers.{l}.{s}"));
        let (wq, wk, wv, wo) =
            (p("self_attn.q_proj.weight"), p("self_attn.k_proj.weight"), p("self_attn.v_proj.weight"), p("self_attn.o_proj.weight"));
        let (n1, n2) = (p("input_layernorm.weight"), p("post_attention_layernorm.weight"));
        let (wg, wu, wd) = (p("mlp.gate_proj.weight"), p("mlp.up_proj.weight"), p("mlp.down_proj.weight"));
        let normed: Vec<Vec<f64>> = xs.iter().map(|x| rms_norm(x, &n1)).collect();
        let heads = |wm: &[f64], n: usize, rotate: bool| -> Vec<Vec<Vec<f64>>> {
            normed
                .iter()
                .enumerate()
                .map(|(pos, x)| {
                    let y = matvec(wm, x);
                    (0..n)
                        .map(|k| {
                            let mut v = y[k * hd..(k + 1) * hd].to_vec();
                            if rotate {
                                rope(&mut v, pos);
                            }
                            v
                        })
                        .collect()
                })
                .collect()
        };
        let (q, k, v) = (heads(&wq, SHAPE.heads, true), heads(&wk, SHAPE.kv_heads, true), heads(&wv, SHAPE.kv_heads, false));
        let group = SHAPE.heads / SHAPE.kv_heads;
        for i in 0..xs.len() {
            let mut attn = Vec::with_capacity(SHAPE.heads * hd);
            for (head, qh) in q[i].iter().enumerate() {
                let kv = head / group;
                let scores: Vec<f64> =
                    (0..=i).map(|j| qh.iter().zip(&k[j][kv]).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()).collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let z: f64 = e.iter().sum();
                attn.extend((0..hd).map(|d| (0..=i).map(|j| e[j] / z * v[j][kv][d]).sum::<f64>()));
            }
            let o = matvec(&wo, &attn);
            xs[i].iter_mut().zip(&o).for_each(|(x, y)| *x += y);
        }
        for x in &mut xs {
            let n = rms_norm(x, &n2);
            let (g, u) = (matvec(&wg, &n), matvec(&wu, &n));
            let act: Vec<f64> = g.iter().zip(&u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
            let d = matvec(&wd, &act);
            x.iter_mut().zip(&d).for_each(|(x, y)| *x += y);
        }
    }
    let norm = tensor(w, "model.norm.weight");
    xs.iter().map(|x| rms_norm(x, &norm)).collect()
}

/// Mean pooling, then unit length (the server's `--pooler-config`).
fn reference_embedding(w: &SafetensorsWeights, ids: &[u32]) -> Vec<f64> {
    let hidden = reference_hidden(w, ids);
    let mean: Vec<f64> = (0..SHAPE.hidden).map(|d| hidden.iter().map(|x| x[d]).sum::<f64>() / hidden.len() as f64).collect();
    let norm = mean.iter().map(|v| v * v).sum::<f64>().sqrt();
    mean.iter().map(|v| v / norm).collect()
}

fn write_checkpoint(dir: &Path) {
    write_random_checkpoint(dir, &SHAPE, CheckpointDtype::F32, 5, 1 << 30, |_, _| {}).expect("writes the checkpoint");
    // Declared Matryoshka, so that requests may ask for fewer dimensions.
    let path = dir.join("config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("config")).expect("JSON");
    config["matryoshka_dimensions"] = serde_json::json!([16, 32, 64]);
    std::fs::write(&path, config.to_string()).expect("writes config");
}

#[test]
fn embeddings_answer_the_openai_client_and_match_a_float64_reference() {
    let python = python_with_openai();
    let dir = std::env::temp_dir().join(format!("vellum-serve-embeddings-{}", std::process::id()));
    write_checkpoint(&dir);
    let weights = SafetensorsWeights::open(&dir).expect("opens");
    let prompts: Vec<Vec<u32>> = vec![
        b"The quick brown fox jumps over the lazy dog.".iter().map(|&b| u32::from(b)).collect(),
        (0..100).map(|i| (i * 53 + 7) % 256).collect(),
        vec![42],
    ];
    let expected: Vec<Vec<f64>> = prompts.iter().map(|p| reference_embedding(&weights, p)).collect();
    let expected_path = dir.join("expected.json");
    std::fs::write(&expected_path, serde_json::json!({"prompts": prompts, "embeddings": expected}).to_string()).expect("writes");

    let model = dir.to_string_lossy().into_owned();
    let server = Server::start(&[
        "--model",
        &model,
        "--served-model-name",
        "tiny-embed",
        "--task",
        "embed",
        "--pooler-config",
        r#"{"pooling_type": "MEAN", "normalize": true}"#,
        "--cpu-precision",
        "float32",
        "--max-num-batched-tokens",
        "64",
        "--kv-cache-memory",
        "16MiB",
        "--max-model-len",
        "256",
    ]);
    run_python(&python, "openai_embeddings.py", &[server.base_url(), expected_path.to_string_lossy().into_owned()]);
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A server started to generate refuses `/v1/embeddings` with a 400 that
/// says how to serve them; one started to embed refuses generation.
#[test]
fn each_task_refuses_the_others_endpoints_with_a_400() {
    let gen = Server::start(&["--kv-cache-memory", "16MiB", "--max-model-len", "256"]);
    let (status, body) = gen.request("POST", "/v1/embeddings", &[("Content-Type", "application/json")], r#"{"input": "hi"}"#);
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("--task embed"), "{body}");
    drop(gen);

    let dir = std::env::temp_dir().join(format!("vellum-serve-embeddings-task-{}", std::process::id()));
    write_checkpoint(&dir);
    let model = dir.to_string_lossy().into_owned();
    // A base-model architecture (no LM head) is an embedding model by itself.
    let path = dir.join("config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("config")).expect("JSON");
    config["architectures"] = serde_json::json!(["LlamaModel"]);
    std::fs::write(&path, config.to_string()).expect("writes config");
    let embed = Server::start(&["--model", &model, "--kv-cache-memory", "16MiB", "--max-model-len", "256"]);
    assert!(embed.log_contains("serving embeddings"), "--task auto picks embed for a base model");
    let (status, body) =
        embed.request("POST", "/v1/completions", &[("Content-Type", "application/json")], r#"{"prompt": "hi", "max_tokens": 2}"#);
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("serves embeddings"), "{body}");
    let (status, body) = embed.request("POST", "/v1/embeddings", &[("Content-Type", "application/json")], r#"{"input": "hi"}"#);
    assert_eq!(status, 200, "{body}");
    drop(embed);
    let _ = std::fs::remove_dir_all(&dir);
}

/// An encoder (a tiny random BERT, `write_random_bert`) served for
/// embeddings: `/v1/models` gives its positions as the context, an input
/// may take every one of them (the pooling request's output slot is never
/// computed), `truncate_prompt_tokens` keeps `[CLS]` … `[SEP]` as BERT's
/// tokenizer truncates, and chat is refused with the task, not a template
/// error.
#[test]
fn an_encoder_takes_inputs_of_every_position_and_truncates_keeping_cls_and_sep() {
    use vellum_formats::{write_random_bert, BertOptions, BertShape};
    let dir = std::env::temp_dir().join(format!("vellum-serve-embeddings-bert-{}", std::process::id()));
    let shape = BertShape { hidden: 32, intermediate: 64, layers: 2, heads: 4, max_positions: 24 };
    write_random_bert(&dir, &shape, &BertOptions { seed: 3, prefixed: false, minimal_config: false, pooling: Some("cls") })
        .expect("writes");
    let server = Server::start(&["--model", &dir.to_string_lossy()]);
    let json = [("Content-Type", "application/json")];
    let (status, body) = server.get("/v1/models");
    assert_eq!(status, 200, "{body}");
    let models: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(models["data"][0]["max_model_len"], 24, "the model's positions: {body}");
    let embed = |input: serde_json::Value, extra: serde_json::Value| -> (u16, serde_json::Value) {
        let mut req = serde_json::json!({"input": input});
        req.as_object_mut().expect("object").extend(extra.as_object().cloned().unwrap_or_default());
        let (status, body) = server.request("POST", "/v1/embeddings", &json, &req.to_string());
        (status, serde_json::from_str(&body).unwrap_or(serde_json::Value::String(body)))
    };
    // 24 ids: [CLS], 22 words, [SEP] — every position.
    let full: Vec<u32> = std::iter::once(2).chain((0..22).map(|i| 4 + i % 16)).chain(std::iter::once(3)).collect();
    let (status, body) = embed(serde_json::json!(full), serde_json::json!({}));
    assert_eq!(status, 200, "24 tokens fit 24 positions: {body}");
    let (status, body) = embed(
        serde_json::json!([2, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 4, 5, 6, 7, 8, 9, 10, 3]),
        serde_json::json!({}),
    );
    assert_eq!(status, 400, "25 tokens: {body}");
    // "the cat sat on the mat ." truncated to 5 keeps [CLS] the cat sat [SEP].
    let (status, cut) = embed(serde_json::json!("the cat sat on the mat ."), serde_json::json!({"truncate_prompt_tokens": 5}));
    assert_eq!(status, 200, "{cut}");
    let (_, ids) = embed(serde_json::json!([[2, 4, 5, 6, 3]]), serde_json::json!({}));
    assert_eq!(cut["data"][0]["embedding"], ids["data"][0]["embedding"], "the truncated text is [CLS] the cat sat [SEP]");
    assert_eq!(cut["usage"]["prompt_tokens"], 5);
    let (status, body) = server.request(
        "POST",
        "/v1/chat/completions",
        &json,
        &serde_json::json!({"model": models["data"][0]["id"], "messages": [{"role": "user", "content": "hi"}]}).to_string(),
    );
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("--task embed"), "{body}");
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}
