//! Engine logic on a fake model: sampling statistics, beam search against an
//! exhaustive search, parallel-sample sharing, prompt logprobs, aborts and a
//! mixed workload, each checked against an independent computation.
//!
//! The fake model is a *paged token store*: its "KV cache" keeps the token
//! written at every slot, and its logits are a pseudo-random function of the
//! whole prefix read back through the block table. A wrong slot mapping,
//! block table, copy-on-write or swap therefore changes the logits, so these
//! tests also check the engine's bookkeeping against the KV layout.

use std::collections::HashMap;
use vellum_base::{
    BeamSearchParams, BlockAllocator, ForwardBatch, ModelExecutor, PreemptionMode, SamplingParams, SchedulerConfig, SchedulingPolicy,
    StepOutput, TokenId,
};
use vellum_engine::sampler::log_softmax;
use vellum_engine::{EngineCore, RequestOutput};
use vellum_scheduler::FinishReason;

const EOS: TokenId = 0;

/// Logits of the fake model after `prefix`: deterministic in (seed, prefix).
fn fake_logits(seed: u64, vocab: usize, prefix: &[TokenId]) -> Vec<f32> {
    let mut h = seed ^ 0xcbf2_9ce4_8422_2325;
    for &t in prefix {
        h = (h ^ t as u64).wrapping_mul(0x0100_0000_01b3);
    }
    (0..vocab)
        .map(|i| {
            let mut x = h ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            x ^= x >> 31;
            x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x ^= x >> 29;
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 6.0 - 3.0
        })
        .collect()
}

struct FakeModel {
    seed: u64,
    vocab: usize,
    block_size: usize,
    slots: Vec<Option<TokenId>>,
    host: Vec<Option<TokenId>>,
    /// Time each step takes (a real model takes some).
    step_time: std::time::Duration,
    /// Panics in this forward pass (1-based): a backend bug.
    panic_at_step: Option<usize>,
    /// Fails this forward pass (1-based) with an error: a backend fault
    /// such as an allocation failure.
    error_at_step: Option<usize>,
    steps: usize,
    /// Returns each row's argmax instead of the logits when a batch is
    /// `argmax_only`, as the CUDA backend does, counting those steps here.
    device_argmax: Option<std::sync::Arc<std::sync::atomic::AtomicUsize>>,
    /// Samples the rows of batches that carry `sampling` itself (through
    /// the host's reference of that contract, `sampler::sample_row`), as
    /// the CUDA backend does, counting those steps here.
    device_sampling: Option<std::sync::Arc<std::sync::atomic::AtomicUsize>>,
}

impl FakeModel {
    fn new(seed: u64, vocab: usize) -> Self {
        Self {
            seed,
            vocab,
            block_size: 0,
            slots: Vec::new(),
            host: Vec::new(),
            step_time: std::time::Duration::ZERO,
            panic_at_step: None,
            error_at_step: None,
            steps: 0,
            device_argmax: None,
            device_sampling: None,
        }
    }
}

impl ModelExecutor for FakeModel {
    fn describe(&self) -> String {
        "paged token store".into()
    }

    fn kv_block_bytes(&self, block_size: usize) -> u64 {
        block_size as u64
    }

    fn kv_memory(&self, _block_size: usize) -> vellum_base::KvMemory {
        vellum_base::KvMemory { available_bytes: 1 << 20, max_blocks: None, device: None }
    }

    fn samples_on_device(&self) -> bool {
        self.device_sampling.is_some()
    }

    fn initialize_kv_cache(&mut self, num_blocks: usize, num_host_blocks: usize, block_size: usize) -> vellum_base::Result<()> {
        self.block_size = block_size;
        self.slots = vec![None; num_blocks * block_size];
        self.host = vec![None; num_host_blocks * block_size];
        Ok(())
    }

    fn execute(&mut self, b: &ForwardBatch) -> vellum_base::Result<StepOutput> {
        std::thread::sleep(self.step_time);
        self.steps += 1;
        assert!(self.panic_at_step != Some(self.steps), "FakeModel: a backend bug at step {}", self.steps);
        if self.error_at_step == Some(self.steps) {
            return Err(vellum_base::Error::OutOfMemory { what: format!("step {} (injected)", self.steps), bytes: 1 << 30 });
        }
        let bs = self.block_size;
        for s in &b.block_ops.swap_out {
            let (d, h) = (s.device.0 as usize * bs, s.host.0 as usize * bs);
            let block: Vec<_> = self.slots[d..d + bs].to_vec();
            self.host[h..h + bs].copy_from_slice(&block);
        }
        for s in &b.block_ops.swap_in {
            let (d, h) = (s.device.0 as usize * bs, s.host.0 as usize * bs);
            let block: Vec<_> = self.host[h..h + bs].to_vec();
            self.slots[d..d + bs].copy_from_slice(&block);
        }
        for c in &b.block_ops.copies {
            let (src, dst) = (c.src.0 as usize * bs, c.dst.0 as usize * bs);
            let block: Vec<_> = self.slots[src..src + bs].to_vec();
            self.slots[dst..dst + bs].copy_from_slice(&block);
        }
        for (i, &slot) in b.slot_mapping.iter().enumerate() {
            self.slots[slot as usize] = Some(b.token_ids[i]);
        }
        let mut logits = Vec::with_capacity(b.logits_indices.len() * self.vocab);
        for &row in &b.logits_indices {
            let s = b.query_start_loc.windows(2).position(|w| (w[0]..w[1]).contains(&row)).expect("row in a sequence");
            let pos = b.positions[row as usize] as usize;
            let table = &b.block_tables[s * b.block_table_stride..(s + 1) * b.block_table_stride];
            let prefix: Vec<TokenId> = (0..=pos)
                .map(|p| self.slots[table[p / bs] as usize * bs + p % bs].expect("every slot of the context was written"))
                .collect();
            logits.extend(fake_logits(self.seed, self.vocab, &prefix));
        }
        if let (Some(count), true) = (&self.device_argmax, b.argmax_only) {
            count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let argmax = logits.chunks(self.vocab).map(argmax).collect();
            return Ok(StepOutput { vocab_size: self.vocab, argmax, ..StepOutput::default() });
        }
        if let (Some(count), false) = (&self.device_sampling, b.sampling.is_empty()) {
            count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let samples = logits
                .chunks(self.vocab)
                .zip(&b.sampling)
                .map(|(row, s)| vellum_engine::sampler::sample_row(row, s, &b.penalties[s.penalties.0 as usize..s.penalties.1 as usize]))
                .collect();
            return Ok(StepOutput { vocab_size: self.vocab, samples, ..StepOutput::default() });
        }
        Ok(StepOutput { logits, vocab_size: self.vocab, ..StepOutput::default() })
    }
}

fn engine(seed: u64, vocab: usize, num_blocks: usize, config: SchedulerConfig) -> EngineCore<FakeModel> {
    EngineCore::new(FakeModel::new(seed, vocab), config, num_blocks, 64, 4, vec![EOS]).expect("engine")
}

fn config() -> SchedulerConfig {
    SchedulerConfig { max_model_len: 256, max_num_batched_tokens: 64, ..SchedulerConfig::default() }
}

fn run(e: &mut EngineCore<FakeModel>, prompts: &[Vec<TokenId>], params: &SamplingParams) -> Vec<RequestOutput> {
    for p in prompts {
        e.add_request(p.clone(), params.clone()).expect("accepted");
    }
    let out = e.run_to_completion().expect("runs");
    assert_eq!(e.scheduler().allocator().stats().num_used_blocks, 0, "every block returned");
    out
}

fn argmax(v: &[f32]) -> TokenId {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as TokenId
}

#[test]
fn greedy_follows_the_model_and_temperature_zero_is_greedy() {
    let prompts: Vec<Vec<TokenId>> = (0..6).map(|i| (1..=(3 + 5 * i)).map(|t| (t % 40 + 1) as TokenId).collect()).collect();
    let mut e = engine(7, 50, 128, config());
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(12) };
    for (p, out) in prompts.iter().zip(run(&mut e, &prompts, &params)) {
        let mut seq = p.clone();
        for &t in &out.outputs[0].token_ids {
            assert_eq!(t, argmax(&fake_logits(7, 50, &seq)), "greedy picks the arg-max of the model");
            seq.push(t);
        }
        assert_eq!(out.outputs[0].token_ids.len(), 12);
    }
}

/// A backend that samples on its device (the CUDA backend's
/// `sample_rows`; here the host's reference of that contract) gives the
/// host sampler's tokens, logprobs and top logprobs for every kind of
/// request the device takes (seeded draws with top-k/top-p/min-p, penalties
/// and logit bias, logprobs, the later draws of parallel sampling), and the
/// requests it leaves to the host (beam search, a parallel request's first
/// draw) mix in the same run: the engine draws each row's uniform number in
/// the host's order and advances the generators as the host would.
#[test]
fn sampling_on_the_device_gives_the_host_samplers_outputs() {
    let prompts: Vec<Vec<TokenId>> = (0..7).map(|i| (1..=(4 + 3 * i)).map(|t| (t * 7 % 45 + 1) as TokenId).collect()).collect();
    let base = SamplingParams { ignore_eos: true, temperature: 0.9, ..SamplingParams::greedy(10) };
    let params = [
        SamplingParams { seed: Some(1), top_p: 0.9, ..base.clone() },
        SamplingParams { seed: Some(2), top_k: 5, min_p: 0.1, logprobs: Some(3), ..base.clone() },
        SamplingParams {
            seed: Some(3),
            repetition_penalty: 1.4,
            frequency_penalty: 0.5,
            presence_penalty: 0.2,
            logit_bias: vec![(7, 3.0), (9, -50.0)],
            ..base.clone()
        },
        SamplingParams { seed: Some(4), n: 3, ..base.clone() },
        SamplingParams { repetition_penalty: 1.3, logprobs: Some(2), ..SamplingParams::greedy(10) },
        SamplingParams { seed: Some(5), ..base.clone() },
        SamplingParams { beam_search: Some(BeamSearchParams { beam_width: 2, length_penalty: 1.0 }), ..SamplingParams::greedy(6) },
    ];
    let outputs = |device: bool| {
        let count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let model = FakeModel { device_sampling: device.then(|| count.clone()), ..FakeModel::new(11, 50) };
        let mut e = EngineCore::new(model, config(), 128, 64, 4, vec![EOS]).expect("engine");
        for (p, params) in prompts.iter().zip(&params) {
            e.add_request(p.clone(), params.clone()).expect("accepted");
        }
        let mut out = e.run_to_completion().expect("runs");
        out.sort_by_key(|o| o.request_id);
        assert_eq!(e.scheduler().allocator().stats().num_used_blocks, 0);
        (out, count.load(std::sync::atomic::Ordering::Relaxed))
    };
    let (host, none) = outputs(false);
    let (device, steps) = outputs(true);
    assert_eq!(none, 0);
    assert!(steps > 0, "some steps sampled on the device");
    assert_eq!(host.len(), device.len());
    for (h, d) in host.iter().zip(&device) {
        assert_eq!(h.outputs.len(), d.outputs.len());
        for (a, b) in h.outputs.iter().zip(&d.outputs) {
            assert_eq!(a.token_ids, b.token_ids, "request {}", h.request_id);
            assert_eq!(format!("{:?}", a.logprobs), format!("{:?}", b.logprobs), "request {}", h.request_id);
        }
    }
}

/// A backend that returns the argmax of `argmax_only` batches (the CUDA
/// backend's greedy path) gives the same tokens as host sampling; a request
/// that wants logprobs keeps its batches off that path.
#[test]
fn argmax_from_the_device_gives_the_host_samplers_greedy_tokens() {
    let prompts: Vec<Vec<TokenId>> = (0..5).map(|i| (1..=(4 + 3 * i)).map(|t| (t % 40 + 1) as TokenId).collect()).collect();
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(10) };
    let host = run(&mut engine(7, 50, 128, config()), &prompts, &params);
    let device_engine = |count: &std::sync::Arc<std::sync::atomic::AtomicUsize>| {
        let model = FakeModel { device_argmax: Some(count.clone()), ..FakeModel::new(7, 50) };
        EngineCore::new(model, config(), 128, 64, 4, vec![EOS]).expect("engine")
    };
    let count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let device = run(&mut device_engine(&count), &prompts, &params);
    assert!(count.load(std::sync::atomic::Ordering::Relaxed) > 0, "greedy batches took the device path");
    for (h, d) in host.iter().zip(&device) {
        assert_eq!(h.outputs[0].token_ids, d.outputs[0].token_ids);
    }
    // Logprobs wanted: the logits come back, and the logprobs with them.
    let count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let with_logprobs = SamplingParams { logprobs: Some(2), ..params.clone() };
    let out = run(&mut device_engine(&count), &prompts, &with_logprobs);
    assert_eq!(count.load(std::sync::atomic::Ordering::Relaxed), 0);
    for (h, o) in host.iter().zip(&out) {
        assert_eq!(h.outputs[0].token_ids, o.outputs[0].token_ids);
        assert_eq!(o.outputs[0].logprobs.len(), 10);
    }
}

#[test]
fn top_k_top_p_and_min_p_never_emit_excluded_tokens() {
    let vocab = 30;
    let prompts: Vec<Vec<TokenId>> = (0..8).map(|i| vec![i + 1, 2 * i + 3, 5]).collect();
    let cases = [
        SamplingParams { top_k: 3, ..SamplingParams::default() },
        SamplingParams { top_p: 0.5, ..SamplingParams::default() },
        SamplingParams { min_p: 0.3, temperature: 1.5, ..SamplingParams::default() },
    ];
    for (ci, base) in cases.iter().enumerate() {
        let params = SamplingParams { max_tokens: Some(20), ignore_eos: true, seed: None, ..base.clone() };
        let mut e = engine(11, vocab, 256, config());
        for (p, out) in prompts.iter().zip(run(&mut e, &prompts, &params)) {
            let mut seq = p.clone();
            for &t in &out.outputs[0].token_ids {
                let lp = log_softmax(&fake_logits(11, vocab, &seq));
                let mut order: Vec<usize> = (0..vocab).collect();
                order.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]));
                let rank = order.iter().position(|&x| x == t as usize).expect("in vocab");
                let allowed = match ci {
                    0 => rank < 3,
                    1 => order[..rank].iter().map(|&x| (lp[x] as f64).exp()).sum::<f64>() < 0.5,
                    _ => {
                        // min_p applies after temperature.
                        let scaled: Vec<f32> = fake_logits(11, vocab, &seq).iter().map(|x| x / 1.5).collect();
                        let p = log_softmax(&scaled);
                        (p[t as usize] as f64).exp() >= 0.3 * (p[order[0]] as f64).exp()
                    }
                };
                assert!(allowed, "case {ci}: token {t} of rank {rank} is excluded");
                seq.push(t);
            }
        }
    }
}

#[test]
fn seeded_requests_reproduce_whatever_the_batch() {
    let vocab = 40;
    let target = vec![3, 1, 4, 1, 5, 9, 2, 6];
    let params = SamplingParams { seed: Some(42), temperature: 0.9, max_tokens: Some(16), ignore_eos: true, ..SamplingParams::default() };
    let alone = run(&mut engine(3, vocab, 128, config()), std::slice::from_ref(&target), &params);
    let mut crowd: Vec<Vec<TokenId>> = (0..5).map(|i| vec![i + 2; 5 + i as usize * 7]).collect();
    crowd.insert(2, target.clone());
    let other = SamplingParams { seed: None, ..params.clone() };
    let mut e = engine(3, vocab, 128, SchedulerConfig { max_num_batched_tokens: 16, ..config() });
    for (i, p) in crowd.iter().enumerate() {
        e.add_request(p.clone(), if i == 2 { params.clone() } else { other.clone() }).expect("accepted");
    }
    let outs = e.run_to_completion().expect("runs");
    assert_eq!(outs[2].outputs[0].token_ids, alone[0].outputs[0].token_ids, "same seed → same tokens, batched or not");
    let unseeded: Vec<_> = outs.iter().enumerate().filter(|(i, _)| *i != 2).map(|(_, o)| o.outputs[0].token_ids.clone()).collect();
    assert!(unseeded.windows(2).any(|w| w[0] != w[1]), "different requests draw differently");
}

/// Every complete hypothesis (ends in EOS, or reaches `max_len` tokens) with
/// its cumulative logprob.
fn exhaustive(seed: u64, vocab: usize, prompt: &[TokenId], max_len: usize, eos: bool) -> Vec<(Vec<TokenId>, f64)> {
    let mut out = Vec::new();
    let mut stack = vec![(Vec::new(), 0.0f64)];
    while let Some((gen, cum)) = stack.pop() {
        let mut prefix = prompt.to_vec();
        prefix.extend(&gen);
        let lp = log_softmax(&fake_logits(seed, vocab, &prefix));
        for t in 0..vocab as TokenId {
            let mut g = gen.clone();
            g.push(t);
            let c = cum + lp[t as usize] as f64;
            if (eos && t == EOS) || g.len() == max_len {
                out.push((g, c));
            } else {
                stack.push((g, c));
            }
        }
    }
    out
}

#[test]
fn beam_search_wide_enough_finds_the_exhaustive_optimum() {
    let vocab: usize = 4;
    let max_len: usize = 4;
    for seed in 0..6u64 {
        let prompt: Vec<TokenId> = vec![1, 2, 3, (seed % 3) as TokenId + 1];
        // Wide enough to keep every prefix: beam search is then exact.
        let width = vocab.pow(max_len as u32 - 1);
        for (eos, length_penalty) in [(true, 0.0f32), (false, 1.0)] {
            let all = exhaustive(seed, vocab, &prompt, max_len, eos);
            let score = |g: &[TokenId], c: f64| c / (g.len() as f64).powf(length_penalty as f64);
            let best = all.iter().max_by(|a, b| score(&a.0, a.1).total_cmp(&score(&b.0, b.1))).expect("some");
            let params = SamplingParams {
                n: 2,
                max_tokens: Some(max_len),
                ignore_eos: !eos,
                beam_search: Some(BeamSearchParams { beam_width: width, length_penalty }),
                ..SamplingParams::greedy(max_len)
            };
            let mut e = engine(seed, vocab, 512, SchedulerConfig { max_num_seqs: 256, max_num_batched_tokens: 512, ..config() });
            let out = run(&mut e, std::slice::from_ref(&prompt), &params);
            let top = &out[0].outputs[0];
            assert_eq!(out[0].outputs.len(), 2, "n best returned");
            assert_eq!(top.token_ids, best.0, "seed {seed}, eos {eos}: beam search's best is the exhaustive optimum");
            let cumulative = |o: &vellum_engine::SequenceOutput| o.cumulative_logprob.expect("a beam search reports logprobs");
            assert!((cumulative(top) - best.1).abs() < 1e-4);
            let second = &out[0].outputs[1];
            assert!(score(&second.token_ids, cumulative(second)) <= score(&top.token_ids, cumulative(top)));
        }
    }
}

#[test]
fn narrow_beam_beats_or_ties_greedy_and_shares_blocks() {
    let vocab = 20;
    let prompt: Vec<TokenId> = (1..=33).collect();
    let params = SamplingParams {
        max_tokens: Some(12),
        beam_search: Some(BeamSearchParams { beam_width: 4, length_penalty: 0.0 }),
        ignore_eos: true,
        ..SamplingParams::greedy(12)
    };
    let mut e = engine(5, vocab, 256, config());
    e.add_request(prompt.clone(), params).expect("accepted");
    let mut saw_sharing = false;
    let mut outs = Vec::new();
    while e.has_unfinished_requests() {
        outs.extend(e.step().expect("step"));
        let kv = e.scheduler().allocator().stats();
        saw_sharing |= kv.num_logical_blocks > kv.num_used_blocks;
    }
    outs.extend(e.take_finished());
    let greedy = run(
        &mut engine(5, vocab, 256, config()),
        std::slice::from_ref(&prompt),
        &SamplingParams { ignore_eos: true, logprobs: Some(0), ..SamplingParams::greedy(12) },
    );
    let (g, b) = (greedy[0].outputs[0].cumulative_logprob.expect("logprobs asked"), outs[0].outputs[0].cumulative_logprob.expect("beam"));
    assert_eq!(outs[0].outputs[0].token_ids.len(), 12);
    assert!(b >= g - 1e-6, "beam {b} < greedy {g}");
    assert!(saw_sharing, "beam candidates share the prompt's blocks");
    assert_eq!(e.scheduler().allocator().stats().num_used_blocks, 0);
}

#[test]
fn parallel_samples_share_prompt_blocks_in_the_kv_accounting() {
    let prompt: Vec<TokenId> = (1..=64).map(|t| t % 30 + 1).collect();
    let params = SamplingParams { n: 4, max_tokens: Some(8), ignore_eos: true, seed: Some(1), ..SamplingParams::default() };
    let mut e = engine(9, 40, 256, config());
    e.add_request(prompt, params).expect("accepted");
    let mut best_saving = 0;
    let mut outs = Vec::new();
    while e.has_unfinished_requests() {
        outs.extend(e.step().expect("step"));
        let kv = e.scheduler().allocator().stats();
        best_saving = best_saving.max(kv.num_logical_blocks - kv.num_used_blocks);
    }
    // 64 prompt tokens = 16 full blocks of 4, held once instead of 4 times.
    assert!(best_saving >= 3 * 16, "sharing saved {best_saving} blocks");
    let o = &outs[0].outputs;
    assert_eq!(o.len(), 4);
    assert_eq!(o.iter().map(|s| s.index).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
    assert!(o.iter().all(|s| s.token_ids.len() == 8));
    // No logprobs asked: none computed or reported (vLLM's None).
    assert!(o.iter().all(|s| s.token_logprobs.is_empty() && s.cumulative_logprob.is_none()));
    assert_eq!(e.scheduler().allocator().stats().num_used_blocks, 0);
}

#[test]
fn prompt_logprobs_match_the_model_with_chunking_and_a_cached_prefix() {
    let vocab = 25;
    let prompt: Vec<TokenId> = (0..37).map(|i| (i * 7 % 24 + 1) as TokenId).collect();
    let params = SamplingParams { prompt_logprobs: Some(3), ..SamplingParams::greedy(2) };
    // Small budget: the prompt is computed in chunks. Twice: the second
    // request would hit the prefix cache, which prompt logprobs bypass.
    let mut e = engine(13, vocab, 128, SchedulerConfig { max_num_batched_tokens: 8, ..config() });
    for _ in 0..2 {
        let out = run(&mut e, std::slice::from_ref(&prompt), &params);
        let pl = out[0].prompt_logprobs.as_ref().expect("asked for");
        assert_eq!(pl.len(), prompt.len());
        assert!(pl[0].is_none(), "nothing predicts the first token");
        for pos in 1..prompt.len() {
            let p = pl[pos].as_ref().unwrap_or_else(|| panic!("position {pos} computed"));
            let lp = log_softmax(&fake_logits(13, vocab, &prompt[..pos]));
            assert_eq!(p.token_id, prompt[pos]);
            assert!((p.logprob - lp[prompt[pos] as usize]).abs() < 1e-6);
            assert_eq!(p.top.len(), 3);
            assert_eq!(p.top[0].0, argmax(&lp));
        }
    }
    // A prompt chunk with prompt logprobs has as many logits rows as
    // tokens, yet is no uniform decode: only each request's one decode
    // step (its second token) counts.
    let c = e.counters();
    assert_eq!(c.decode_steps, 2, "{c:?}");
    assert!(c.num_steps > 8, "{c:?}");
}

#[test]
fn aborting_frees_every_block_at_once() {
    let mut e = engine(1, 30, 64, config());
    let mut ids = Vec::new();
    for i in 0..6u32 {
        let prompt: Vec<TokenId> = (0..(10 + 9 * i)).map(|t| t % 29 + 1).collect();
        let n = 1 + (i as usize % 3);
        let params = SamplingParams { n, max_tokens: Some(50), ignore_eos: true, ..SamplingParams::default() };
        ids.push(e.add_request(prompt, params).expect("accepted"));
    }
    for _ in 0..5 {
        e.step().expect("step");
    }
    assert!(e.scheduler().allocator().stats().num_used_blocks > 0);
    for id in ids {
        assert!(e.finish_request(id, FinishReason::Abort));
    }
    assert_eq!(e.scheduler().allocator().stats().num_used_blocks, 0, "freed before any further step");
    let outs = e.take_finished();
    assert_eq!(outs.len(), 6);
    assert!(outs.iter().all(|o| o.outputs.iter().all(|s| s.finish_reason == Some(FinishReason::Abort))));
    assert!(!e.has_unfinished_requests());
    e.scheduler().assert_invariants();
}

/// Deterministic mixed parameters for request `i`.
fn mixed_params(i: usize) -> SamplingParams {
    let max_tokens = Some(1 + (i * 7) % 24);
    match i % 6 {
        0 => SamplingParams { max_tokens, ..SamplingParams::greedy(1) },
        1 => SamplingParams { n: 3, max_tokens, seed: Some(i as u64), ..SamplingParams::default() },
        2 => SamplingParams {
            max_tokens,
            beam_search: Some(BeamSearchParams { beam_width: 3, length_penalty: 1.0 }),
            ..SamplingParams::greedy(1)
        },
        3 => SamplingParams { max_tokens, top_k: 5, logprobs: Some(2), ..SamplingParams::default() },
        4 => SamplingParams { max_tokens, n: 2, best_of: Some(3), top_p: 0.8, ..SamplingParams::default() },
        _ => SamplingParams { max_tokens, prompt_logprobs: Some(1), repetition_penalty: 1.3, ..SamplingParams::default() },
    }
}

/// Adds 200 requests of `mixed_params`, arriving ten at a time between
/// steps, and steps until every one finished (the scheduler's invariants
/// checked after each step); the outputs in request order.
fn run_two_hundred_mixed(e: &mut EngineCore<FakeModel>) -> Vec<RequestOutput> {
    let mut outs = Vec::new();
    for i in 0..200 {
        let prompt: Vec<TokenId> = (0..(2 + (i * 13) % 40)).map(|t| ((t + i) % 31 + 1) as TokenId).collect();
        let id = e.add_request(prompt, mixed_params(i)).expect("accepted");
        assert_eq!(id.0 as usize, i, "ids in arrival order");
        if i % 10 == 9 {
            outs.extend(e.step().expect("step"));
            e.scheduler().assert_invariants();
        }
    }
    while e.has_unfinished_requests() {
        outs.extend(e.step().expect("step"));
        e.scheduler().assert_invariants();
    }
    outs.extend(e.take_finished());
    outs.sort_by_key(|o| o.request_id);
    outs
}

#[test]
fn two_hundred_mixed_requests_under_memory_pressure_return_every_block() {
    for mode in [PreemptionMode::Recompute, PreemptionMode::Swap] {
        let config = SchedulerConfig { preemption_mode: mode, max_num_batched_tokens: 96, ..config() };
        // 60 blocks of 4 tokens: far fewer than the load wants, so requests
        // are preempted and resumed throughout.
        let mut e = EngineCore::new(FakeModel::new(21, 32), config, 60, 120, 4, vec![EOS]).expect("engine");
        let outs = run_two_hundred_mixed(&mut e);
        assert_eq!(outs.len(), 200, "{mode:?}: every request finished");
        for o in &outs {
            let p = &mixed_params(o.request_id.0 as usize);
            assert_eq!(o.outputs.len(), p.n, "{mode:?}: n outputs");
            for s in &o.outputs {
                assert!(!s.token_ids.is_empty() && s.token_ids.len() <= p.max_tokens.unwrap_or(0));
                if p.logprobs.is_some() {
                    assert_eq!(s.logprobs.len(), s.token_ids.len());
                }
            }
            if p.prompt_logprobs.is_some() {
                let pl = o.prompt_logprobs.as_ref().expect("prompt logprobs");
                assert!(pl.iter().skip(1).all(Option::is_some), "{mode:?}: every prompt position, even after preemption");
            }
        }
        let kv = e.scheduler().allocator().stats();
        assert_eq!(kv.num_used_blocks, 0, "{mode:?}: every block returned");
        assert_eq!(kv.num_used_host_blocks, 0, "{mode:?}: every host block returned");
        assert!(e.scheduler().num_preemptions() > 0, "{mode:?}: the load did preempt");
    }
}

#[test]
fn engine_client_streams_tokens_and_frees_blocks_of_dropped_streams() {
    use vellum_engine::{EngineClient, RequestEvent};
    let mut model = FakeModel::new(17, 40);
    model.step_time = std::time::Duration::from_millis(2);
    let client = EngineClient::spawn(EngineCore::new(model, config(), 128, 64, 4, vec![EOS]).expect("engine"));
    // Eight callers on their own threads, each streaming one request.
    let handles: Vec<_> = (0..8u32)
        .map(|i| {
            let c = client.clone();
            std::thread::spawn(move || {
                let prompt: Vec<TokenId> = (0..(5 + i)).map(|t| t % 39 + 1).collect();
                let params =
                    SamplingParams { ignore_eos: true, n: 1 + (i as usize % 2), seed: Some(i as u64), ..SamplingParams::default() };
                let params = SamplingParams { max_tokens: Some(10), ..params };
                let mut stream = c.add_request(prompt, params, 0).expect("accepted");
                let mut streamed: HashMap<usize, Vec<TokenId>> = HashMap::new();
                loop {
                    match stream.next_blocking() {
                        Some(RequestEvent::Delta(d)) => streamed.entry(d.index).or_default().extend(d.token_ids),
                        Some(RequestEvent::Finished(out)) => return (streamed, out),
                        Some(RequestEvent::Error(e)) => panic!("engine error: {e}"),
                        None => panic!("stream ended without Finished"),
                    }
                }
            })
        })
        .collect();
    for h in handles {
        let (streamed, out) = h.join().expect("caller");
        for o in &out.outputs {
            assert_eq!(streamed.get(&o.index), Some(&o.token_ids), "the deltas add up to the final tokens");
            assert_eq!(o.token_ids.len(), 10);
        }
    }
    // A caller that goes away mid-stream: its request is aborted.
    let long = SamplingParams { ignore_eos: true, max_tokens: Some(200), ..SamplingParams::default() };
    let mut stream = client.add_request(vec![1, 2, 3, 4, 5, 6, 7, 8, 9], long, 0).expect("accepted");
    assert!(matches!(stream.next_blocking(), Some(RequestEvent::Delta(_))));
    drop(stream);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let s = client.stats();
        if s.num_aborted_by_disconnect == 1 && s.num_running == 0 && s.num_waiting == 0 {
            assert_eq!(s.kv.num_used_blocks, 0, "the dropped request's blocks are free");
            assert_eq!(s.finished_by_reason, [0, 8, 1], "8 by length, 1 aborted");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "abort not applied: {s:?}");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // Bad input comes back as a typed error, before any stream exists.
    let too_long = SamplingParams { max_tokens: Some(1000), ..SamplingParams::default() };
    assert!(client.add_request(vec![1, 2, 3], too_long, 0).is_err());
    client.shutdown();
    assert!(client.add_request(vec![1], SamplingParams::default(), 0).is_err(), "no requests after shutdown");
}

/// A caller that stops reading its stream: once its buffer holds all but
/// one event, the request is aborted and its blocks freed, the stream ends
/// with an error after the buffered events, and a reading caller's request
/// runs to the end meanwhile.
#[test]
fn a_stalled_reader_is_aborted_with_its_buffer_bounded_and_others_go_on() {
    use vellum_engine::{EngineClient, RequestEvent};
    let mut model = FakeModel::new(23, 40);
    // Steps slow enough for the reading caller to keep up whatever the load.
    model.step_time = std::time::Duration::from_millis(2);
    let client = EngineClient::spawn_with_stream_buffer(EngineCore::new(model, config(), 128, 64, 4, vec![EOS]).expect("engine"), 8);
    let long = SamplingParams { ignore_eos: true, max_tokens: Some(60), ..SamplingParams::default() };
    let mut stalled = client.add_request(vec![1, 2, 3, 4, 5], long.clone(), 0).expect("accepted");
    let mut reader = client.add_request(vec![6, 7, 8], long, 0).expect("accepted");
    let mut read = 0;
    loop {
        match reader.next_blocking() {
            Some(RequestEvent::Delta(d)) => read += d.token_ids.len(),
            Some(RequestEvent::Finished(out)) => {
                assert_eq!(out.outputs[0].token_ids.len(), 60, "the reading caller's request ran to the end");
                break;
            }
            other => panic!("reader: {other:?}"),
        }
    }
    assert_eq!(read, 60);
    // The stalled stream holds at most 8 events: 7 deltas, then the error.
    let mut events = Vec::new();
    while let Some(ev) = stalled.next_blocking() {
        events.push(ev);
    }
    assert!(events.len() <= 8, "{} events buffered", events.len());
    assert!(events[..events.len() - 1].iter().all(|e| matches!(e, RequestEvent::Delta(_))));
    assert!(matches!(events.last(), Some(RequestEvent::Error(m)) if m.contains("behind")), "{:?}", events.last());
    // The stats snapshot follows the step that sent the last event.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let s = client.stats();
        if s.num_running == 0 && s.num_waiting == 0 {
            assert_eq!(s.num_aborted_slow_reader, 1);
            assert_eq!(s.kv.num_used_blocks, 0, "the stalled request's blocks are free");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "still running: {s:?}");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    client.shutdown();
}

/// A panic in the engine thread (here, in the backend) never leaves a
/// caller waiting: every live stream ends with an error, the client reports
/// the engine dead, and new requests are refused.
#[test]
fn an_engine_thread_panic_ends_every_live_stream_with_an_error_and_the_client_reports_it() {
    use vellum_engine::{EngineClient, RequestEvent};
    let mut model = FakeModel::new(23, 40);
    model.panic_at_step = Some(4);
    // Steps that take a while, so that all three requests arrive before it.
    model.step_time = std::time::Duration::from_millis(20);
    let client = EngineClient::spawn(EngineCore::new(model, config(), 128, 64, 4, vec![EOS]).expect("engine"));
    assert!(client.is_alive());
    let long = SamplingParams { ignore_eos: true, max_tokens: Some(50), ..SamplingParams::default() };
    let mut streams: Vec<_> = (0..3).map(|i| client.add_request(vec![1, 2, 3 + i], long.clone(), 0).expect("accepted")).collect();
    for s in &mut streams {
        let mut last = None;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while let Some(ev) = s.next_blocking() {
            last = Some(ev);
            assert!(std::time::Instant::now() < deadline, "stream never ended");
        }
        assert!(matches!(&last, Some(RequestEvent::Error(m)) if m.contains("engine failed")), "{last:?}");
    }
    assert!(!client.is_alive(), "the client reports the engine dead");
    assert!(client.add_request(vec![1], SamplingParams::default(), 0).is_err(), "no requests after the engine died");
    client.shutdown();
}

/// A backend error (here an injected allocation failure in one forward
/// pass) fails the requests of that step with an error event that names it,
/// frees their blocks, and the engine goes on: a request sent afterwards
/// completes with the tokens it would have had anyway.
#[test]
fn a_backend_error_fails_the_live_requests_and_the_engine_goes_on() {
    use vellum_engine::{EngineClient, RequestEvent};
    let mut model = FakeModel::new(29, 40);
    model.error_at_step = Some(6);
    model.step_time = std::time::Duration::from_millis(10);
    let client = EngineClient::spawn(EngineCore::new(model, config(), 128, 64, 4, vec![EOS]).expect("engine"));
    let long = SamplingParams { ignore_eos: true, max_tokens: Some(50), ..SamplingParams::default() };
    let mut streams: Vec<_> = (0..3).map(|i| client.add_request(vec![1, 2, 3 + i], long.clone(), 0).expect("accepted")).collect();
    // Each request ends: with the error if the failed step carried it,
    // else in full (one that arrived after the failure).
    let mut failed = 0;
    for s in &mut streams {
        let mut last = None;
        while let Some(ev) = s.next_blocking() {
            last = Some(ev);
        }
        match &last {
            Some(RequestEvent::Error(m)) => {
                assert!(m.contains("engine failed") && m.contains("out of device memory"), "{m}");
                failed += 1;
            }
            Some(RequestEvent::Finished(out)) => assert_eq!(out.outputs[0].token_ids.len(), 50, "{out:?}"),
            other => panic!("the stream ended with {other:?}"),
        }
    }
    assert!(failed >= 1, "the failed step carried at least the first request");
    assert!(client.is_alive(), "a backend error is not an engine death");
    // The engine goes on: every block is back, and a new request runs to
    // the end with the tokens a fresh engine gives it.
    let short = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(8) };
    let mut after = client.add_request(vec![7, 8, 9], short.clone(), 0).expect("accepted after the error");
    let mut finished = None;
    while let Some(ev) = after.next_blocking() {
        match ev {
            RequestEvent::Finished(out) => finished = Some(out),
            RequestEvent::Error(m) => panic!("the request after the error failed: {m}"),
            RequestEvent::Delta(_) => {}
        }
    }
    let finished = finished.expect("the request after the error finishes");
    let alone = run(&mut engine(29, 40, 128, config()), &[vec![7, 8, 9]], &short);
    assert_eq!(finished.outputs[0].token_ids, alone[0].outputs[0].token_ids);
    // The stats refresh after the step that sent the last event.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while client.stats().num_running + client.stats().num_waiting > 0 || client.stats().kv.num_used_blocks > 0 {
        assert!(std::time::Instant::now() < deadline, "not idle after the error: {:?}", client.stats());
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    client.shutdown();
}

#[test]
fn finishing_one_parallel_sample_frees_its_blocks_and_the_rest_go_on() {
    let prompt: Vec<TokenId> = (1..=9).collect();
    let params = SamplingParams { n: 3, max_tokens: Some(30), ignore_eos: true, seed: Some(4), ..SamplingParams::default() };
    let mut e = engine(23, 40, 128, config());
    let id = e.add_request(prompt, params).expect("accepted");
    for _ in 0..4 {
        e.step().expect("step");
    }
    let used = e.scheduler().allocator().stats().num_used_blocks;
    assert!(e.finish_sequence(id, 1, FinishReason::Stop));
    assert!(!e.finish_sequence(id, 1, FinishReason::Stop), "already finished");
    assert!(e.scheduler().allocator().stats().num_used_blocks < used, "its own blocks were freed");
    let outs = e.run_to_completion().expect("runs");
    let o = &outs[0].outputs;
    assert_eq!(o[1].finish_reason, Some(FinishReason::Stop));
    assert!(o[1].token_ids.len() < 30);
    assert_eq!((o[0].token_ids.len(), o[2].token_ids.len()), (30, 30), "the siblings ran to the end");
    assert_eq!(e.scheduler().allocator().stats().num_used_blocks, 0);
}

/// The shape of the random checkpoints the CPU tests write: two layers of
/// 64, 4 query and 2 KV heads, the byte-level vocabulary and a little more.
#[cfg(feature = "cpu")]
const TINY_LLAMA: vellum_formats::CheckpointShape = vellum_formats::CheckpointShape {
    hidden: 64,
    intermediate: 160,
    layers: 2,
    heads: 4,
    kv_heads: 2,
    vocab: 300,
    max_positions: 256,
    rope_theta: 10_000.0,
};

/// A random-weight Llama checkpoint written by `vellum-formats` (bf16,
/// sharded, with its index, config and byte-level tokenizer) is what the
/// loaders read and the engine runs: the GPU benchmarks write 8B ones of it.
#[cfg(feature = "cpu")]
#[test]
fn a_written_random_checkpoint_loads_and_generates_on_the_cpu() {
    use vellum_formats::{write_random_checkpoint, CheckpointDtype};
    let root = std::env::temp_dir().join(format!("vellum-random-checkpoint-{}", std::process::id()));
    let shape = TINY_LLAMA;
    let (a, b) = (root.join("a"), root.join("b"));
    let mut calls = 0;
    let report = write_random_checkpoint(&a, &shape, CheckpointDtype::Bf16, 7, 40_000, |done, total| {
        calls += 1;
        assert!(done <= total);
    })
    .expect("writes");
    assert_eq!(report.weight_bytes, 2 * shape.parameters());
    assert!(report.shards >= 3, "{report:?}: a shard limit of 40 kB splits it");
    assert_eq!(calls, report.tensors);
    // The same seed writes the same bytes.
    write_random_checkpoint(&b, &shape, CheckpointDtype::Bf16, 7, 40_000, |_, _| {}).expect("writes");
    for k in 1..=report.shards {
        let name = format!("model-{k:05}-of-{:05}.safetensors", report.shards);
        assert_eq!(std::fs::read(a.join(&name)).expect("shard"), std::fs::read(b.join(&name)).expect("shard"), "{name}");
    }

    let args = vellum_engine::EngineArgs { model: Some(a.to_string_lossy().into_owned()), ..Default::default() };
    let mut llm = vellum_engine::Llm::new(args).expect("the engine loads the written checkpoint");
    let params = SamplingParams { temperature: 0.0, max_tokens: Some(6), ignore_eos: true, logprobs: Some(1), ..SamplingParams::default() };
    let out = llm.generate(&["hello, wörld"], &params).expect("generates");
    let seq = &out[0].outputs[0];
    // "hello, wörld": 13 bytes, each a token, after <|begin_of_text|>.
    assert_eq!(out[0].prompt_token_ids.len(), 14, "{:?}", out[0].prompt_token_ids);
    assert_eq!(seq.token_ids.len(), 6);
    assert!(seq.token_ids.iter().all(|&t| (t as usize) < shape.vocab));
    assert!(seq.logprobs.iter().flatten().all(|(_, lp)| lp.is_finite() && *lp <= 0.0), "{:?}", seq.logprobs);

    // A step's prompt compute in FLOPs (`vellum serve` on a GPU) becomes a
    // prefill budget once the model is loaded: its layers' weights, twice,
    // a token; none where the whole step fits.
    let per_token = 2 * shape.layers as u64 * {
        let (h, d) = (shape.hidden as u64, (shape.hidden / shape.heads) as u64);
        2 * h * shape.heads as u64 * d + 2 * h * shape.kv_heads as u64 * d + 3 * h * shape.intermediate as u64
    };
    for (flops, tokens) in [(None, 0), (Some(1024.0 * per_token as f64), 1024), (Some(1.0), 256), (Some(1e15), 0)] {
        let args =
            vellum_engine::EngineArgs { model: Some(a.to_string_lossy().into_owned()), step_flop_budget: flops, ..Default::default() };
        let mut llm = vellum_engine::Llm::new(args).expect("loads");
        let config = llm.engine().scheduler().config().clone();
        assert_eq!((config.max_num_prefill_tokens, config.max_num_batched_tokens), (tokens, 2048), "{flops:?} FLOPs a step");
    }
    let _ = std::fs::remove_dir_all(&root);
}

// ---- Speculative decoding --------------------------------------------------

/// Proposes the fake model's greedy continuation with every `wrong_every`-th
/// draft position replaced by another token: verifications that accept all,
/// some and none of their drafts.
struct OracleProposer {
    seed: u64,
    vocab: usize,
    wrong_every: usize,
    calls: usize,
}

impl vellum_engine::Proposer for OracleProposer {
    fn propose(&mut self, requests: &[vellum_engine::DraftRequest<'_>], drafts: &mut [Vec<TokenId>]) -> Result<(), vellum_engine::Error> {
        for (r, d) in requests.iter().zip(drafts) {
            self.calls += 1;
            let mut prefix = r.tokens.to_vec();
            for i in 0..r.max_drafts {
                let best = argmax(&fake_logits(self.seed, self.vocab, &prefix));
                let t = if (self.calls + i).is_multiple_of(self.wrong_every) { (best + 1) % self.vocab as TokenId } else { best };
                d.push(t);
                prefix.push(t);
            }
        }
        Ok(())
    }

    fn describe(&self) -> String {
        "oracle".into()
    }
}

#[test]
fn speculation_gives_the_tokens_and_logprobs_of_plain_decoding() {
    let vocab = 24;
    let prompts: Vec<Vec<TokenId>> = (0..6).map(|i| (0..3 + i * 5).map(|t| (t * 7 + i) as TokenId % 23 + 1).collect()).collect();
    let cases = [
        SamplingParams { max_tokens: Some(40), ignore_eos: true, ..SamplingParams::greedy(1) },
        SamplingParams { max_tokens: Some(40), logprobs: Some(3), ..SamplingParams::greedy(1) },
        SamplingParams { seed: Some(7), temperature: 0.8, max_tokens: Some(40), ignore_eos: true, ..SamplingParams::default() },
        SamplingParams {
            seed: Some(9),
            temperature: 1.1,
            top_k: 8,
            top_p: 0.9,
            repetition_penalty: 1.2,
            presence_penalty: 0.3,
            logprobs: Some(2),
            max_tokens: Some(40),
            ..SamplingParams::default()
        },
    ];
    for params in cases {
        let plain = run(&mut engine(5, vocab, 256, config()), &prompts, &params);
        let mut e = engine(5, vocab, 256, config());
        e.set_proposer(Box::new(OracleProposer { seed: 5, vocab, wrong_every: 5, calls: 0 }), 4);
        let spec = run(&mut e, &prompts, &params);
        for (a, b) in plain.iter().zip(&spec) {
            assert_eq!(a.outputs[0].token_ids, b.outputs[0].token_ids, "{params:?}");
            assert_eq!(a.outputs[0].finish_reason, b.outputs[0].finish_reason);
            assert_eq!(a.outputs[0].logprobs, b.outputs[0].logprobs, "top logprobs of every position");
            let same = |x: &[f32], y: &[f32]| x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p == q || (p.is_nan() && q.is_nan()));
            assert!(same(&a.outputs[0].token_logprobs, &b.outputs[0].token_logprobs));
        }
        let c = e.spec_decode_counters();
        assert!(c.num_accepted_tokens > 0 && c.num_accepted_tokens < c.num_draft_tokens, "{params:?}: {c:?}");
        // Verifications carry several tokens a sequence: not uniform
        // decodes. Greedy, the oracle drafts at nearly every step.
        let counted = e.counters();
        if params.temperature == 0.0 {
            assert!(counted.decode_steps <= 1 && counted.num_steps > 10, "{params:?}: {counted:?}");
        }
        if params.temperature == 0.0 {
            let steps = e.counters().num_steps;
            assert!(steps < 30, "{params:?}: {steps} steps for 40 tokens; {c:?}");
        }
    }
}

/// 80 mixed requests (`mixed_params`, seeded) on the fake model with
/// `num_blocks` blocks of 4 tokens and a step budget of `budget`, speculating
/// with the oracle or not; checks every block comes back. Returns the
/// outputs in request order, the speculation counters and the preemptions.
fn run_mixed(
    mode: PreemptionMode,
    policy: SchedulingPolicy,
    num_blocks: usize,
    budget: usize,
    spec: bool,
) -> (Vec<RequestOutput>, vellum_engine::SpecDecodeCounters, u64) {
    let config = SchedulerConfig { preemption_mode: mode, policy, max_num_batched_tokens: budget, ..config() };
    let mut e = EngineCore::new(FakeModel::new(21, 32), config, num_blocks, 2 * num_blocks, 4, vec![EOS]).expect("engine");
    if spec {
        e.set_proposer(Box::new(OracleProposer { seed: 21, vocab: 32, wrong_every: 4, calls: 0 }), 5);
    }
    for i in 0..80 {
        let prompt: Vec<TokenId> = (0..(2 + (i * 13) % 40)).map(|t| ((t + i) % 31 + 1) as TokenId).collect();
        // Seeded draws, so that each request's tokens are its own whatever
        // the batch and the preemptions.
        e.add_request(prompt, SamplingParams { seed: Some(i as u64), ..mixed_params(i) }).expect("accepted");
    }
    let mut outs = Vec::new();
    while e.has_unfinished_requests() {
        outs.extend(e.step().expect("step"));
        e.scheduler().assert_invariants();
        e.scheduler().allocator().assert_invariants();
    }
    outs.extend(e.take_finished());
    outs.sort_by_key(|o| o.request_id);
    let kv = e.scheduler().allocator().stats();
    assert_eq!((kv.num_used_blocks, kv.num_used_host_blocks), (0, 0), "{mode:?}: every block returned");
    (outs, e.spec_decode_counters(), e.scheduler().num_preemptions())
}

/// Asserts that every request has the same tokens in `a` and `b`: greedy,
/// seeded draws, beam search, and parallel samples (after its first draw
/// each sequence draws from a generator of its own, so another batch
/// history changes nothing).
fn assert_same_tokens(a: &[RequestOutput], b: &[RequestOutput], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let toks = |o: &RequestOutput| o.outputs.iter().map(|s| s.token_ids.clone()).collect::<Vec<_>>();
        assert_eq!(toks(x), toks(y), "{what}: request {i}");
    }
}

#[test]
fn preemption_by_swap_or_recompute_leaves_every_sequences_tokens_unchanged() {
    // Ample memory against 60 blocks: the same tokens. (Swapping a group
    // back in and out again in one step used to copy out blocks before
    // their swap-in had filled them; a beam search recomputing after a
    // preemption used to rank its first candidate alone and drop the rest.)
    let policies = [SchedulingPolicy::Fcfs, SchedulingPolicy::TwoLevel { staging_queue_size: 8 }];
    for (mode, policy) in [PreemptionMode::Recompute, PreemptionMode::Swap].into_iter().flat_map(|m| policies.map(|p| (m, p))) {
        let (roomy, _, none) = run_mixed(mode, policy, 2048, 40, false);
        assert_eq!(none, 0);
        for budget in [37, 40] {
            let (tight, _, preemptions) = run_mixed(mode, policy, 60, budget, false);
            assert!(preemptions > 0, "{mode:?}: the load did preempt");
            assert_same_tokens(&roomy, &tight, &format!("{mode:?}, {policy:?}, budget {budget}"));
        }
    }
}

#[test]
fn speculation_mixed_with_other_requests_under_preemption_returns_every_block() {
    for mode in [PreemptionMode::Recompute, PreemptionMode::Swap] {
        let (plain, _, _) = run_mixed(mode, SchedulingPolicy::Fcfs, 60, 40, false);
        let (spec, c, preemptions) = run_mixed(mode, SchedulingPolicy::Fcfs, 60, 40, true);
        assert!(preemptions > 0, "{mode:?}: the load did preempt");
        assert_same_tokens(&plain, &spec, &format!("{mode:?}"));
        assert!(c.num_accepted_tokens > 0 && c.num_accepted_tokens < c.num_draft_tokens, "{mode:?}: {c:?}");
    }
}

#[test]
fn speculative_sampling_keeps_the_target_distribution() {
    // Two tokens drawn at temperature 1 from 6,000 unseeded requests, the
    // second one always drafted as the greedy token (accepted with its
    // probability, else replaced by another draw): the joint frequencies
    // against the model's exact probabilities, by chi-square.
    let (vocab, seed) = (6, 11);
    let prompt: Vec<TokenId> = vec![1, 2, 3];
    let params = SamplingParams { temperature: 1.0, max_tokens: Some(3), ignore_eos: true, ..SamplingParams::default() };
    let mut e = engine(seed, vocab, 4096, SchedulerConfig { max_num_batched_tokens: 4096, ..config() });
    e.set_proposer(Box::new(OracleProposer { seed, vocab, wrong_every: usize::MAX, calls: 0 }), 1);
    let runs = 6000;
    let mut counts = vec![0usize; vocab * vocab];
    for _ in 0..runs / 500 {
        for out in run(&mut e, &vec![prompt.clone(); 500], &params) {
            let t = &out.outputs[0].token_ids;
            counts[t[0] as usize * vocab + t[1] as usize] += 1;
        }
    }
    assert!(e.spec_decode_counters().num_drafts >= runs as u64, "every second token was verified");
    let p1 = log_softmax(&fake_logits(seed, vocab, &prompt));
    let mut chi2 = 0.0;
    for a in 0..vocab {
        let mut prefix = prompt.clone();
        prefix.push(a as TokenId);
        let p2 = log_softmax(&fake_logits(seed, vocab, &prefix));
        for b in 0..vocab {
            let expected = runs as f64 * (p1[a] as f64 + p2[b] as f64).exp();
            let seen = counts[a * vocab + b] as f64;
            chi2 += (seen - expected).powi(2) / expected;
        }
    }
    // 35 degrees of freedom: the 0.999 quantile is 66.6.
    assert!(chi2 < 66.6, "chi-square {chi2:.1} over 35 degrees of freedom");
}

// ---- Embeddings (pooling) ----------------------------------------------------

/// Pooling reads the hidden states a causal model computes: the state at
/// position `p` depends on the tokens up to `p` alone, so the mean over a
/// prompt is the mean of the last-token states of its prefixes, and the
/// first token's state is the last-token state of the one-token prefix.
/// Those identities hold whatever the batch, the chunking of the prefill
/// and the prefix-cache hits, which the engine must not disturb.
#[cfg(feature = "cpu")]
#[test]
fn pooled_embeddings_agree_with_the_prefixes_last_states_whatever_the_batching() {
    use vellum_base::{PoolingParams, PoolingType};
    use vellum_engine::{CpuPrecision, EngineArgs, Llm, PoolerConfig, Task};
    use vellum_formats::{write_random_checkpoint, CheckpointDtype};
    let dir = std::env::temp_dir().join(format!("vellum-embed-checkpoint-{}", std::process::id()));
    let shape = TINY_LLAMA;
    write_random_checkpoint(&dir, &shape, CheckpointDtype::F32, 11, 1 << 30, |_, _| {}).expect("writes");
    let engine = |pooling_type: PoolingType, normalize: bool, max_batched: usize| {
        let scheduler = SchedulerConfig { max_num_batched_tokens: max_batched, max_model_len: 256, ..SchedulerConfig::default() };
        Llm::new(EngineArgs {
            model: Some(dir.to_string_lossy().into_owned()),
            task: Task::Embed,
            pooler_config: PoolerConfig { pooling_type: Some(pooling_type), normalize: Some(normalize) },
            cpu_precision: CpuPrecision::Float32,
            scheduler,
            ..Default::default()
        })
        .expect("loads for embeddings")
    };
    let prompt: Vec<TokenId> = (0..40).map(|i| (i * 37 % 256) as TokenId).collect();
    let close = |a: &[f32], b: &[f32], what: &str| {
        assert_eq!(a.len(), b.len(), "{what}");
        let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs() / y.abs().max(1.0)).fold(0.0f32, f32::max);
        assert!(worst < 2e-4, "{what}: worst relative difference {worst}");
    };

    let mut last = engine(PoolingType::Last, false, 2048);
    assert_eq!(
        last.embedding().map(|s| s.defaults),
        Some(PoolingParams { pooling_type: PoolingType::Last, normalize: false, dimensions: None })
    );
    let prefixes: Vec<Vec<TokenId>> = (1..=prompt.len()).map(|n| prompt[..n].to_vec()).collect();
    // Every prefix in one batch, and each alone (the prefix cache then hits).
    let batched = last.embed_ids(&prefixes, None).expect("embeds");
    assert_eq!(batched.len(), prompt.len());
    assert!(batched.iter().all(|v| v.len() == shape.hidden && v.iter().all(|x| x.is_finite())));
    for (n, p) in prefixes.iter().enumerate().step_by(7) {
        close(&last.embed_ids(std::slice::from_ref(p), None).expect("embeds")[0], &batched[n], "one by one = batched");
    }
    assert_eq!(last.engine().kv_stats().num_used_blocks, 0, "pooling requests free their blocks");
    let mean_of_prefixes: Vec<f32> =
        (0..shape.hidden).map(|d| batched.iter().map(|v| f64::from(v[d])).sum::<f64>() as f32 / prompt.len() as f32).collect();

    // Mean pooling, with the prompt in chunks of 16 tokens and in one piece;
    // the second time after a request that put the prompt's first blocks in
    // the prefix cache (which a MEAN request must not use: a hit would skip
    // the positions it averages).
    for max_batched in [16, 2048] {
        let mut mean = engine(PoolingType::Mean, false, max_batched);
        if max_batched == 2048 {
            mean.embed_ids(&[prompt[..33].to_vec()], None).expect("embeds");
        }
        let got = mean.embed_ids(std::slice::from_ref(&prompt), None).expect("embeds");
        close(&got[0], &mean_of_prefixes, &format!("mean = mean of the prefixes' last states (chunks of {max_batched})"));
    }
    let mut cls = engine(PoolingType::Cls, false, 16);
    cls.embed_ids(&[prompt[..17].to_vec()], None).expect("embeds");
    close(&cls.embed_ids(std::slice::from_ref(&prompt), None).expect("embeds")[0], &batched[0], "CLS = the first token's state");

    // Normalized: unit length, the same direction.
    let mut unit = engine(PoolingType::Last, true, 2048);
    let v = &unit.embed_ids(std::slice::from_ref(&prompt), None).expect("embeds")[0];
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    assert!((norm - 1.0).abs() < 1e-5, "{norm}");
    let raw = &batched[prompt.len() - 1];
    let raw_norm = raw.iter().map(|x| x * x).sum::<f32>().sqrt();
    close(v, &raw.iter().map(|x| x / raw_norm).collect::<Vec<_>>(), "normalized = the state over its norm");

    // Under memory pressure: prompts preempted mid-prefill (recompute, or
    // swapped to the host and back) pool the same vectors as alone.
    let prompts: Vec<Vec<TokenId>> = (0..6).map(|k| (0..40).map(|i| ((i * 29 + k * 7) % 256) as TokenId).collect()).collect();
    let alone: Vec<Vec<f32>> = prompts
        .iter()
        .map(|p| engine(PoolingType::Mean, false, 2048).embed_ids(std::slice::from_ref(p), None).expect("embeds")[0].clone())
        .collect();
    for mode in [PreemptionMode::Recompute, PreemptionMode::Swap] {
        // Three prompts take 16 tokens each a step: they outgrow 5 blocks together.
        let scheduler = SchedulerConfig {
            max_num_batched_tokens: 48,
            long_prefill_token_threshold: 16,
            max_model_len: 256,
            preemption_mode: mode,
            ..SchedulerConfig::default()
        };
        let mut tight = Llm::new(EngineArgs {
            model: Some(dir.to_string_lossy().into_owned()),
            task: Task::Embed,
            pooler_config: PoolerConfig { pooling_type: Some(PoolingType::Mean), normalize: Some(false) },
            cpu_precision: CpuPrecision::Float32,
            kv_cache: vellum_base::KvCacheSize::NumBlocks(5),
            swap_space_bytes: 1 << 20,
            scheduler,
            ..Default::default()
        })
        .expect("loads for embeddings");
        let got = tight.embed_ids(&prompts, None).expect("embeds");
        for (g, a) in got.iter().zip(&alone) {
            close(g, a, &format!("{mode:?}: preempted = alone"));
        }
        assert!(tight.engine().queue_stats().num_preemptions > 0, "{mode:?}: the cache is small enough to preempt");
        assert_eq!(tight.engine().kv_stats().num_used_blocks, 0, "{mode:?}: every block comes back");
    }

    // Not a Matryoshka model: `dimensions` is refused; so is generation.
    let e = unit.embed_ids(std::slice::from_ref(&prompt), Some(8)).unwrap_err().to_string();
    assert!(e.contains("Matryoshka"), "{e}");
    let e = unit.generate_ids(std::slice::from_ref(&prompt), &SamplingParams::default()).unwrap_err().to_string();
    assert!(e.contains("embeddings"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Asynchronous scheduling (the next step scheduled and built while the
/// last one runs, on a helper thread) gives every request the outputs of
/// synchronous stepping: 200 mixed requests (greedy, seeded draws with
/// top-k/top-p and logprobs, parallel sampling with best_of, beam search,
/// prompt logprobs with a repetition penalty; stop tokens and max_tokens of
/// 1–24) arriving over time under memory pressure, with preemption by
/// recompute and by swap, with the fake model sampling on its "device" and
/// not; every block comes back, and steps really were scheduled ahead.
#[test]
fn asynchronous_scheduling_gives_the_outputs_of_synchronous_steps() {
    let outputs = |mode: PreemptionMode, device: bool, asynchronous: bool| {
        let config = SchedulerConfig { preemption_mode: mode, max_num_batched_tokens: 96, ..config() };
        let model = FakeModel {
            device_sampling: device.then(|| std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0))),
            ..FakeModel::new(21, 32)
        };
        let mut e = EngineCore::new(model, config, 60, 120, 4, vec![EOS]).expect("engine");
        e.set_async_scheduling(asynchronous);
        assert_eq!(e.async_scheduling(), asynchronous);
        let outs = run_two_hundred_mixed(&mut e);
        assert_eq!(e.scheduler().allocator().stats().num_used_blocks, 0, "{mode:?}: every block returned");
        assert_eq!(e.scheduler().num_steps_in_flight(), 0);
        (outs, e.counters())
    };
    for mode in [PreemptionMode::Recompute, PreemptionMode::Swap] {
        for device in [false, true] {
            let (sync, _) = outputs(mode, device, false);
            let (ahead, counters) = outputs(mode, device, true);
            logprobs_follow_the_model(&sync, 21, 32, &format!("{mode:?}, synchronous"));
            logprobs_follow_the_model(&ahead, 21, 32, &format!("{mode:?}, asynchronous"));
            assert!(counters.schedule_overlapped_s > 0.0, "steps were scheduled while others ran");
            assert_eq!(sync.len(), 200);
            assert_eq!(sync.len(), ahead.len());
            for (a, b) in sync.iter().zip(&ahead) {
                let what = format!("{mode:?}, device sampling {device}, request {}", a.request_id);
                assert_eq!(a.request_id, b.request_id);
                assert_eq!(format!("{:?}", a.prompt_logprobs), format!("{:?}", b.prompt_logprobs), "{what}");
                assert_eq!(a.outputs.len(), b.outputs.len(), "{what}");
                for (x, y) in a.outputs.iter().zip(&b.outputs) {
                    assert_eq!((&x.token_ids, x.finish_reason), (&y.token_ids, y.finish_reason), "{what}");
                    assert_eq!(format!("{:?}", x.logprobs), format!("{:?}", y.logprobs), "{what}");
                    assert_eq!(format!("{:?}", x.cumulative_logprob), format!("{:?}", y.cumulative_logprob), "{what}");
                }
            }
        }
    }
}

/// Every logprob an output reports is the fake model's own for the
/// sequence's tokens so far: the model reads its prefix back through the
/// block tables, so a wrong slot, table, copy or swap anywhere in a
/// sequence's history shows here.
fn logprobs_follow_the_model(outs: &[RequestOutput], seed: u64, vocab: usize, what: &str) {
    let mut checked = 0;
    for o in outs {
        for s in &o.outputs {
            let mut prefix = o.prompt_token_ids.clone();
            for (k, &t) in s.token_ids.iter().enumerate() {
                if let Some(&lp) = s.token_logprobs.get(k).filter(|x| !x.is_nan()) {
                    let want = log_softmax(&fake_logits(seed, vocab, &prefix))[t as usize];
                    assert!(
                        (lp - want).abs() < 1e-4,
                        "{what}: request {}, output {}, token {k}: logprob {lp}, the model's {want}",
                        o.request_id,
                        s.index
                    );
                    checked += 1;
                }
                prefix.push(t);
            }
        }
    }
    assert!(checked > 100, "{what}: only {checked} logprobs to check");
}

/// A sequence ended from outside (a stop string, in the engine's client)
/// ends at once under asynchronous scheduling too, although the sequence
/// left running of a parallel request is always scheduled ahead (a step in
/// flight between calls): the request finishes within a step and returns
/// every block.
#[test]
fn a_sequence_ended_from_outside_under_asynchronous_scheduling_ends_at_once() {
    for asynchronous in [false, true] {
        let mut e = engine(3, 40, 128, config());
        e.set_async_scheduling(asynchronous);
        let params = SamplingParams { n: 2, seed: Some(1), temperature: 1.0, ignore_eos: true, ..SamplingParams::greedy(40) };
        let id = e.add_request((1..=9).collect(), params).expect("accepted");
        for _ in 0..4 {
            e.step().expect("step");
        }
        assert!(e.finish_sequence(id, 1, FinishReason::Stop), "async {asynchronous}: the second sample ends");
        for _ in 0..3 {
            e.step().expect("step");
        }
        assert!(e.finish_sequence(id, 0, FinishReason::Stop), "async {asynchronous}: the last sample ends, a step in flight or not");
        let mut outs = Vec::new();
        let mut steps = 0;
        while e.has_unfinished_requests() {
            outs.extend(e.step().expect("step"));
            steps += 1;
            assert!(steps <= 1, "async {asynchronous}: the request ended within a step");
        }
        outs.extend(e.take_finished());
        assert_eq!(outs.len(), 1);
        let o = &outs[0];
        assert!(o.outputs.iter().all(|s| s.finish_reason == Some(FinishReason::Stop) && s.token_ids.len() < 12), "{:?}", o.outputs);
        assert_eq!(e.scheduler().allocator().stats().num_used_blocks, 0, "async {asynchronous}: every block returned");
    }
}
