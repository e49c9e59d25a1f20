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
    let lse = log_sum_exp(logits);
    logits.iter().map(|&x| logprob(x, lse)).collect()
}

/// `ln Σ exp(x)`, shifted by the maximum. The differences are rounded to
/// f32 before `exp` (a relative error of 2⁻²⁴·|x − max| per term, about
/// 1e-6 nats on the result for the terms that matter) and summed in f64:
/// with a 262,144-token vocabulary this pass is most of a sampling step,
/// and f32 `exp` is several times cheaper than f64.
pub fn log_sum_exp(logits: &[f32]) -> f64 {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    logits.iter().map(|&x| f64::from(((x as f64 - m) as f32).exp())).sum::<f64>().ln() + m
}

/// The log-probability of logit `x` under the normalizer `lse`
/// ([`log_sum_exp`]); [`log_softmax`] is this for every entry.
pub fn logprob(x: f32, lse: f64) -> f32 {
    (x as f64 - lse) as f32
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
    params.repetition_penalty != 1.0 || params.frequency_penalty != 0.0 || params.presence_penalty != 0.0 || !params.logit_bias.is_empty()
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
    sample_normalized(logits, log_sum_exp(logits), params, rng, num_logprobs, history)
}

/// [`sample`] with the row's [`log_sum_exp`] already computed (the engine
/// computes it for all rows in parallel).
pub fn sample_normalized(
    logits: &[f32],
    lse: f64,
    params: &SamplingParams,
    rng: &mut SeededRng,
    num_logprobs: usize,
    history: (&[TokenId], &[TokenId]),
) -> Sample {
    sample_masked(logits, lse, params, rng, num_logprobs, history, None)
}

/// The tokens a structured-output constraint allows: calls `f(token)` for
/// each, in increasing order.
pub type AllowedTokens<'a> = &'a dyn Fn(&mut dyn FnMut(usize));

/// [`sample_normalized`] restricted to the tokens `allowed` lists (a
/// structured-output constraint): every other logit counts as −∞. The
/// reported log-probabilities stay the model's own.
pub fn sample_masked(
    logits: &[f32],
    lse: f64,
    params: &SamplingParams,
    rng: &mut SeededRng,
    num_logprobs: usize,
    history: (&[TokenId], &[TokenId]),
    allowed: Option<AllowedTokens<'_>>,
) -> Sample {
    // The ranking of the logprobs is that of the logits: only the entries
    // asked for (and the chosen one) are normalized.
    let mut top_logprobs: Vec<(TokenId, f32)> = top_k(logits, num_logprobs.max(1)).into_iter().map(|(t, x)| (t, logprob(x, lse))).collect();
    let penalties = has_penalties(params);
    let token = match allowed {
        // Greedy under a constraint: the best allowed token (lowest id on
        // ties), without touching the rest of the vocabulary.
        Some(allowed) if params.temperature == 0.0 && !penalties => {
            let mut best: Option<(usize, f32)> = None;
            allowed(&mut |t| {
                if let Some(&x) = logits.get(t) {
                    if best.is_none_or(|(_, b)| x > b) {
                        best = Some((t, x));
                    }
                }
            });
            best.map_or_else(|| top_logprobs[0].0, |(t, _)| t as TokenId)
        }
        _ => {
            let processed;
            let scores = if penalties || allowed.is_some() {
                let mut l = match allowed {
                    Some(allowed) => {
                        let mut l = vec![f32::NEG_INFINITY; logits.len()];
                        allowed(&mut |t| {
                            if let Some(&x) = logits.get(t) {
                                l[t] = x;
                            }
                        });
                        l
                    }
                    None => logits.to_vec(),
                };
                apply_penalties(&mut l, params, history.0, history.1);
                processed = l;
                &processed[..]
            } else {
                logits
            };
            if params.temperature == 0.0 {
                if scores.as_ptr() == logits.as_ptr() {
                    top_logprobs[0].0
                } else {
                    top_k(scores, 1)[0].0
                }
            } else {
                draw(scores, params, rng)
            }
        }
    };
    top_logprobs.truncate(num_logprobs);
    Sample { token, logprob: logprob(logits[token as usize], lse), top_logprobs }
}

/// Draws a token. Only the candidates the filters can keep are sorted: the
/// top `k`, or for top-p / min-p alone a prefix of the ranking grown until
/// the cut falls inside it; with no filter the draw walks the vocabulary in
/// id order, unsorted.
fn draw(logits: &[f32], params: &SamplingParams, rng: &mut SeededRng) -> TokenId {
    let t = params.temperature as f64;
    let v = logits.len();
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let weight = |x: f32| ((x as f64 - m) / t).exp();
    let k = if params.top_k > 0 { (params.top_k as usize).min(v) } else { v };
    if k == v && params.top_p >= 1.0 && params.min_p <= 0.0 {
        let total: f64 = logits.iter().map(|&x| weight(x)).sum();
        let mut u = rng.uniform() * total;
        for (i, &x) in logits.iter().enumerate() {
            let w = weight(x);
            if u < w {
                return i as TokenId;
            }
            u -= w;
        }
        return argmax(logits);
    }
    // Ranking: larger logit first, lower id on ties.
    let desc = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    let mut order: Vec<u32> = (0..v as u32).collect();
    let z_full = if k == v { logits.iter().map(|&x| weight(x)).sum::<f64>() } else { 0.0 };
    let mut take = if k < v { k } else { 64.min(v) };
    loop {
        if take < v {
            order.select_nth_unstable_by(take - 1, desc);
        }
        order[..take].sort_unstable_by(desc);
        if take == k || take == v {
            break;
        }
        // Without top-k, a prefix suffices once the min-p or top-p cut
        // falls inside it.
        let top = weight(logits[order[0] as usize]);
        let last = weight(logits[order[take - 1] as usize]);
        let mass: f64 = order[..take].iter().map(|&i| weight(logits[i as usize])).sum::<f64>() / z_full;
        if (params.min_p > 0.0 && last < params.min_p as f64 * top) || (params.top_p < 1.0 && mass >= params.top_p as f64) {
            break;
        }
        take = (take * 4).min(v);
    }
    let cand = &order[..take];
    let mut probs: Vec<f64> = cand.iter().map(|&i| weight(logits[i as usize])).collect();
    let total: f64 = if k < v { probs.iter().sum() } else { z_full };
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
            return cand[i];
        }
        u -= p;
    }
    cand[probs.len() - 1]
}

fn argmax(v: &[f32]) -> TokenId {
    top_k(v, 1)[0].0
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
        let s =
            sample(&logits, &SamplingParams { presence_penalty: 1.0, ..SamplingParams::greedy(1) }, &mut SeededRng::new(0), 1, (&[], &[0]));
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

    /// The filters on a large vocabulary (where only a prefix of the ranking
    /// is sorted) keep exactly the set a full sort keeps.
    #[test]
    fn filters_on_a_large_vocabulary_match_a_full_sort() {
        let mut rng = SeededRng::new(9);
        let logits: Vec<f32> = (0..5000).map(|_| (rng.uniform() * 12.0) as f32).collect();
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        let t = 0.7f64;
        let w: Vec<f64> = logits.iter().map(|&x| ((x as f64 - logits[order[0]] as f64) / t).exp()).collect();
        let z: f64 = w.iter().sum();
        for (top_p, min_p) in [(0.9f32, 0.0f32), (1.0, 0.05), (0.5, 0.01)] {
            // Brute force: the allowed set from the full ranking.
            let mut allowed = std::collections::HashSet::new();
            let mut acc = 0.0;
            for &i in &order {
                let p = w[i] / z;
                if (min_p > 0.0 && p < min_p as f64 * w[order[0]] / z) || (top_p < 1.0 && acc >= top_p as f64) {
                    break;
                }
                allowed.insert(i as TokenId);
                acc += p;
            }
            let params = SamplingParams { temperature: t as f32, top_p, min_p, ..SamplingParams::default() };
            let mut seen = std::collections::HashSet::new();
            for _ in 0..3000 {
                let tok = draw(&logits, &params, &mut rng);
                assert!(allowed.contains(&tok), "top_p {top_p} min_p {min_p}: {tok} is excluded");
                seen.insert(tok);
            }
            assert!(
                seen.len() > allowed.len() / 2,
                "top_p {top_p} min_p {min_p}: the allowed set is sampled ({} of {})",
                seen.len(),
                allowed.len()
            );
        }
    }
}
