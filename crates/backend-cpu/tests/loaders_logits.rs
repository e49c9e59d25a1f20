//! The GGUF loader and the Hugging Face loader give the same logits: a tiny
//! random-weight Llama (GQA, q/k/v biases, Q/K stored permuted in the GGUF as
//! llama.cpp's converter does) is written in both formats by the test and run
//! through the CPU backend, prefill then decode.

#[path = "../../models/tests/common/tiny_checkpoint.rs"]
mod tiny_checkpoint;

use tiny_checkpoint::*;
use vellum_backend_cpu::{CpuOps, WeightFormat};
use vellum_base::{ForwardBatch, ModelExecutor};
use vellum_models::ModelRunner;
use vellum_models::{GgufWeights, SafetensorsWeights, WeightSource};

/// ggml's Q8_0 round trip of each row: what the GGUF file holds, computed
/// here independently of the loader.
fn q8_0_round_trip(x: &[f32]) -> Vec<f32> {
    x.chunks(32)
        .flat_map(|block| {
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = half::f16::from_f32(amax / 127.0).to_f32();
            let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
            block.iter().map(move |v| (v * id).round() * d).collect::<Vec<_>>()
        })
        .collect()
}

fn run(weights: &dyn WeightSource) -> Vec<Vec<f32>> {
    let config = weights.model_config().expect("config");
    // The f32 reference path: both loaders must hand over the same values.
    let mut exec = ModelRunner::load(CpuOps::new(WeightFormat::F32), weights, config, |_, _| {}).expect("loads");
    exec.initialize_kv_cache(8, 0, 4).expect("cache");
    let prompt: Vec<u32> = vec![1, 5, 9, 3, 17, 22, 8, 30, 11, 4];
    let table = [3u32, 0, 6]; // out of order on purpose
    let slot = |p: usize| table[p / 4] * 4 + (p % 4) as u32;
    let prefill = ForwardBatch {
        token_ids: prompt.clone(),
        positions: (0..10).collect(),
        slot_mapping: (0..10).map(slot).collect(),
        query_start_loc: vec![0, 10],
        context_lens: vec![10],
        block_tables: table.to_vec(),
        block_table_stride: 3,
        num_kv_groups: 1,
        logits_indices: vec![9],
        ..ForwardBatch::default()
    };
    let decode = ForwardBatch {
        token_ids: vec![13],
        positions: vec![10],
        slot_mapping: vec![slot(10)],
        query_start_loc: vec![0, 1],
        context_lens: vec![11],
        block_tables: table.to_vec(),
        block_table_stride: 3,
        num_kv_groups: 1,
        logits_indices: vec![0],
        ..ForwardBatch::default()
    };
    vec![exec.execute(&prefill).expect("prefill").logits, exec.execute(&decode).expect("decode").logits]
}

#[test]
fn gguf_and_safetensors_give_the_same_logits() {
    let dir = std::env::temp_dir().join(format!("vellum-cpu-loaders-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("hf")).unwrap();
    let mut tensors = tiny_tensors();
    let gguf_path = dir.join("tiny.gguf");
    std::fs::write(&gguf_path, tiny_gguf_writer(&tensors).build().0).unwrap();
    // The Hugging Face copy holds what the GGUF's Q8_0 tensors decode to.
    for t in tensors.iter_mut().filter(|t| t.stored == Stored::Q8_0) {
        t.values = q8_0_round_trip(&t.values);
    }
    write_tiny_hf_dir(&dir.join("hf"), &tensors);

    let from_gguf = run(&GgufWeights::open(&gguf_path).expect("gguf opens"));
    let from_hf = run(&SafetensorsWeights::open(&dir.join("hf")).expect("hf dir opens"));
    for (step, (a, b)) in from_gguf.iter().zip(&from_hf).enumerate() {
        assert_eq!(a.len(), 32);
        let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        assert!(worst < 1e-4, "step {step}: logits differ by up to {worst}");
        assert!(a.iter().any(|x| x.abs() > 1e-3), "logits are not trivially zero");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
