//! Turning a row of logits into a token (and its log-probabilities).

pub use vellum_core::SeededRng;
use vellum_core::{SamplingParams, TokenId};

/// One sampled token with its log-probability and the top alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// The token.
    pub token: TokenId,
    /// Its log-probability under the model (before sampling filters).
    pub logprob: f32,
    /// The `k` most likely (token, logprob), most likely first.
    pub top_logprobs: Vec<(TokenId, f32)>,
}

/// Natural-log softmax of a row, computed in f64 for stability.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = logits.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln() + m;
    logits.iter().map(|&x| (x as f64 - lse) as f32).collect()
}

/// The `k` largest entries, largest first (ties: lower id first).
pub fn top_k(values: &[f32], k: usize) -> Vec<(TokenId, f32)> {
    let mut best: Vec<(TokenId, f32)> = Vec::with_capacity(k + 1);
    for (i, &v) in values.iter().enumerate() {
        if best.len() < k || v > best[best.len() - 1].1 {
            let pos = best.partition_point(|&(_, b)| b >= v);
            best.insert(pos, (i as TokenId, v));
            best.truncate(k);
        }
    }
    best
}

/// Whether `params` asks for any repetition, frequency or presence penalty.
pub fn has_penalties(params: &SamplingParams) -> bool {
    params.repetition_penalty != 1.0
        || params.frequency_penalty != 0.0
        || params.presence_penalty != 0.0
        || !params.logit_bias.is_empty()
}

/// Applies the penalties of `params` to `logits` in place:
/// repetition (Hugging Face style, over prompt and output: a positive logit is
/// divided by the penalty, a negative one multiplied), then frequency
/// (`-= f · count in output`) and presence (`-= p` once a token is in the
/// output), as the OpenAI API and vLLM define them.
pub fn apply_penalties(logits: &mut [f32], params: &SamplingParams, prompt: &[TokenId], output: &[TokenId]) {
    if params.repetition_penalty != 1.0 {
        let mut seen = vec![false; logits.len()];
        for &t in prompt.iter().chain(output) {
            if let Some(s) = seen.get_mut(t as usize) {
                *s = true;
            }
        }
        for (l, s) in logits.iter_mut().zip(&seen) {
            if *s {
                *l = if *l > 0.0 { *l / params.repetition_penalty } else { *l * params.repetition_penalty };
            }
        }
    }
    if params.frequency_penalty != 0.0 || params.presence_penalty != 0.0 {
        let mut counts = std::collections::HashMap::<TokenId, u32>::new();
        for &t in output {
            *counts.entry(t).or_default() += 1;
        }
        for (t, c) in counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= params.frequency_penalty * c as f32 + params.presence_penalty;
            }
        }
    }
    for &(t, bias) in &params.logit_bias {
        if let Some(l) = logits.get_mut(t as usize) {
            *l += bias;
        }
    }
}

/// Samples a token under `params`: greedy at temperature 0, otherwise
/// temperature, top-k, top-p and min-p filtering then a draw from `rng`.
/// `history` (prompt, output) enables the penalties. The reported
/// log-probabilities (`num_logprobs` alternatives) are the model's own,
/// before penalties and filters.
pub fn sample(
    logits: &[f32],
    params: &SamplingParams,
    rng: &mut SeededRng,
    num_logprobs: usize,
    history: (&[TokenId], &[TokenId]),
) -> Sample {
    let logprobs = log_softmax(logits);
    let mut top_logprobs = top_k(&logprobs, num_logprobs.max(1));
    let penalized;
    let scores = if has_penalties(params) {
        let mut l = logits.to_vec();
        apply_penalties(&mut l, params, history.0, history.1);
        penalized = l;
        &penalized[..]
    } else {
        logits
    };
    let token = if params.temperature == 0.0 {
        if scores.as_ptr() == logits.as_ptr() { top_logprobs[0].0 } else { top_k(scores, 1)[0].0 }
    } else {
        draw(scores, params, rng)
    };
    top_logprobs.truncate(num_logprobs);
    Sample { token, logprob: logprobs[token as usize], top_logprobs }
}

fn draw(logits: &[f32], params: &SamplingParams, rng: &mut SeededRng) -> TokenId {
    let t = params.temperature as f64;
    let mut cand: Vec<(TokenId, f64)> = logits.iter().enumerate().map(|(i, &x)| (i as TokenId, x as f64 / t)).collect();
    cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if params.top_k > 0 {
        cand.truncate(params.top_k as usize);
    }
    let m = cand[0].1;
    let mut probs: Vec<f64> = cand.iter().map(|c| (c.1 - m).exp()).collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    if params.min_p > 0.0 {
        let floor = params.min_p as f64 * probs[0];
        let keep = probs.iter().take_while(|&&p| p >= floor).count().max(1);
        probs.truncate(keep);
    }
    if params.top_p < 1.0 {
        let mut acc = 0.0;
        let keep = probs.iter().take_while(|&&p| {
            let before = acc;
            acc += p;
            before < params.top_p as f64
        });
        let keep = keep.count().max(1);
        probs.truncate(keep);
    }
    let total: f64 = probs.iter().sum();
    let mut u = rng.uniform() * total;
    for (i, p) in probs.iter().enumerate() {
        if u < *p {
            return cand[i].0;
        }
        u -= p;
    }
    cand[probs.len() - 1].0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_and_filters() {
        let logits = [0.0, 3.0, 1.0, 2.9, -5.0];
        let g = sample(&logits, &SamplingParams::greedy(1), &mut SeededRng::new(0), 3, (&[], &[]));
        assert_eq!(g.token, 1);
        assert_eq!(g.top_logprobs.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3, 2]);
        let p = SamplingParams { temperature: 1.0, top_k: 2, ..SamplingParams::default() };
        let mut rng = SeededRng::new(1);
        for _ in 0..200 {
            let t = sample(&logits, &p, &mut rng, 0, (&[], &[])).token;
            assert!(t == 1 || t == 3, "top-k 2 emitted {t}");
        }
        let p = SamplingParams { temperature: 1.0, top_p: 0.4, ..SamplingParams::default() };
        for _ in 0..200 {
            assert_eq!(sample(&logits, &p, &mut rng, 0, (&[], &[])).token, 1, "top-p 0.4 keeps only the top token (p ≈ 0.47)");
        }
        let lp = log_softmax(&logits);
        let s: f64 = lp.iter().map(|&x| (x as f64).exp()).sum();
        assert!((s - 1.0).abs() < 1e-6);
    }

    #[test]
    fn penalties_follow_the_openai_and_hf_definitions() {
        let p = SamplingParams { repetition_penalty: 2.0, ..SamplingParams::greedy(1) };
        let mut l = vec![4.0, -4.0, 1.0];
        apply_penalties(&mut l, &p, &[0], &[1]);
        assert_eq!(l, vec![2.0, -8.0, 1.0], "positive divided, negative multiplied, unseen kept");
        let p = SamplingParams { frequency_penalty: 0.5, presence_penalty: 1.0, ..SamplingParams::greedy(1) };
        let mut l = vec![0.0; 3];
        apply_penalties(&mut l, &p, &[2, 2], &[0, 0, 1]);
        assert_eq!(l, vec![-2.0, -1.5, 0.0], "counts come from the output only");
        // Greedy picks the penalized maximum; logprobs stay the model's.
        let logits = [3.0, 2.9, 0.0];
        let s = sample(&logits, &SamplingParams { presence_penalty: 1.0, ..SamplingParams::greedy(1) }, &mut SeededRng::new(0), 1, (&[], &[0]));
        assert_eq!(s.token, 1);
        assert_eq!(s.top_logprobs[0].0, 0);
        // logit_bias: -100 bans a token, +100 forces one.
        let ban = SamplingParams { logit_bias: vec![(0, -100.0)], ..SamplingParams::greedy(1) };
        assert_eq!(sample(&logits, &ban, &mut SeededRng::new(0), 0, (&[], &[])).token, 1);
        let force = SamplingParams { logit_bias: vec![(2, 100.0)], temperature: 1.0, ..SamplingParams::default() };
        let mut rng = SeededRng::new(3);
        for _ in 0..100 {
            assert_eq!(sample(&logits, &force, &mut rng, 0, (&[], &[])).token, 2);
        }
    }
}
