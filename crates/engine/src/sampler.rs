//! Turning a row of logits into a token (and its log-probabilities).

mod vector;

pub use vellum_base::SeededRng;
use vellum_base::{DeviceSample, PenaltyEntry, RowSampling, SamplingParams, TokenId};

/// One sampled token with its log-probability and the top alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// The token.
    pub token: TokenId,
    /// Its log-probability under the model (before sampling filters); NaN
    /// when the request does not want it
    /// ([`SamplingParams::needs_sampled_logprobs`]: the row was not
    /// normalized).
    pub logprob: f32,
    /// The `k` most likely (token, logprob), most likely first.
    pub top_logprobs: Vec<(TokenId, f32)>,
}

/// Natural-log softmax of a row, computed in f64 for stability.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let lse = log_sum_exp(logits);
    logits.iter().map(|&x| logprob(x, lse)).collect()
}

/// `ln Σ exp(x)`, shifted by the maximum: the differences in f32 through a
/// polynomial `exp` within 2 ulp ([`vector::exp_f32`]), summed in f64 (a
/// relative error of about 1e-7 nats on the result). With a 262,144-token
/// vocabulary this pass is most of a sampling step, so it is vectorized.
pub fn log_sum_exp(logits: &[f32]) -> f64 {
    let m = vector::max(logits);
    let mut sums = Vec::new();
    vector::exp_sums(logits, m, 1.0, &mut sums);
    lse_of(m, &sums)
}

/// `ln Σ` of the chunk sums of `exp(x − m)`, plus `m`.
fn lse_of(m: f32, sums: &[f64]) -> f64 {
    sums.iter().sum::<f64>().ln() + m as f64
}

/// What sampling reads of one row of logits, computed once per row (the
/// engine computes every row's in parallel, so that the passes over the
/// vocabulary leave the sequential part of a step): the normalizer, the
/// top entries, and for a draw without filters the weights' chunk sums.
#[derive(Clone, Debug)]
pub struct RowStats {
    /// `ln Σ exp(x)` over the row ([`log_sum_exp`]); NaN when the
    /// request does not want its sampled tokens' logprobs
    /// ([`SamplingParams::needs_sampled_logprobs`]) and the draw did not
    /// need the pass anyway.
    pub lse: f64,
    /// The `k` largest logits (`k ≥ 1`), largest first, lower id first on ties.
    pub top: Vec<(TokenId, f32)>,
    /// For a draw with no filter: the row's maximum, `1/t` and the chunk
    /// sums of the weights `exp((x − max)/t)`.
    plain_draw: Option<PlainDraw>,
}

/// A draw with no filter over a whole row, set up: one pass over the row
/// ([`vector::exp_sums`]); the draw then reads the chunk sums and one chunk.
#[derive(Clone, Debug)]
struct PlainDraw {
    max: f32,
    inv_t: f32,
    sums: Vec<f64>,
}

impl RowStats {
    /// The statistics of `logits` for a row sampled with `params`, keeping
    /// the `num_logprobs` (at least 1) top entries. `constrained`: a
    /// structured-output mask applies (so a draw cannot use the row as is).
    pub fn new(logits: &[f32], params: &SamplingParams, num_logprobs: usize, constrained: bool) -> Self {
        let top = vector::top_k(logits, num_logprobs.max(1));
        let max = top.first().map_or(f32::NEG_INFINITY, |t| t.1);
        let plain = !constrained && is_plain_draw(params, logits.len());
        let inv_t = 1.0 / params.temperature;
        // The normalizer's chunk sums are a plain draw's at temperature 1.
        let mut sums = Vec::new();
        let lse = if params.needs_sampled_logprobs() || (plain && inv_t == 1.0) {
            vector::exp_sums(logits, max, 1.0, &mut sums);
            lse_of(max, &sums)
        } else {
            f64::NAN
        };
        let plain_draw = plain.then(|| {
            if inv_t != 1.0 {
                vector::exp_sums(logits, max, inv_t, &mut sums);
            }
            PlainDraw { max, inv_t, sums }
        });
        RowStats { lse, top, plain_draw }
    }
}

/// Whether `params` draws from the whole distribution as it is: a positive
/// temperature, no top-k/top-p/min-p cut and no penalty.
fn is_plain_draw(params: &SamplingParams, vocab: usize) -> bool {
    params.temperature > 0.0
        && (params.top_k <= 0 || params.top_k as usize >= vocab)
        && params.top_p >= 1.0
        && params.min_p <= 0.0
        && !has_penalties(params)
}

/// The log-probability of logit `x` under the normalizer `lse`
/// ([`log_sum_exp`]); [`log_softmax`] is this for every entry.
pub fn logprob(x: f32, lse: f64) -> f32 {
    (x as f64 - lse) as f32
}

/// The `k` largest entries, largest first (ties: lower id first; NaN
/// ignored once `k` entries are held).
pub fn top_k(values: &[f32], k: usize) -> Vec<(TokenId, f32)> {
    vector::top_k(values, k)
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

/// [`apply_penalties`] as a list for a device sampler: one entry per token
/// of the vocabulary (`vocab`) that a penalty or bias touches, in token
/// order, each applying what [`apply_penalties`] applies to that token in
/// the same order. Empty without penalties; `None` when a token's bias is
/// given twice (applied twice in a row, which one entry cannot express).
pub fn penalty_entries(params: &SamplingParams, prompt: &[TokenId], output: &[TokenId], vocab: usize) -> Option<Vec<PenaltyEntry>> {
    PenaltyHistory::new(prompt, output).entries(params, vocab)
}

/// What the penalties read of a sequence's tokens, kept as its output
/// grows ([`PenaltyHistory::push`]): the distinct tokens of its prompt and
/// the count of each output token. A step's entries
/// ([`PenaltyHistory::entries`]) then read each distinct token once instead
/// of the whole history (a 4,000-token prompt at 256 rows: a million map
/// inserts a step otherwise).
#[derive(Clone, Debug, Default)]
pub struct PenaltyHistory {
    /// Distinct prompt tokens, increasing.
    prompt: Vec<TokenId>,
    /// Output tokens and how often each occurs.
    output: std::collections::BTreeMap<TokenId, u32>,
}

impl PenaltyHistory {
    /// The history of `prompt` followed by `output`.
    pub fn new(prompt: &[TokenId], output: &[TokenId]) -> Self {
        let mut p = prompt.to_vec();
        p.sort_unstable();
        p.dedup();
        let mut h = Self { prompt: p, output: Default::default() };
        output.iter().for_each(|&t| h.push(t));
        h
    }

    /// One more output token.
    pub fn push(&mut self, token: TokenId) {
        *self.output.entry(token).or_default() += 1;
    }

    /// [`penalty_entries`] for the tokens so far.
    pub fn entries(&self, params: &SamplingParams, vocab: usize) -> Option<Vec<PenaltyEntry>> {
        use std::collections::BTreeMap;
        let mut entries: BTreeMap<TokenId, PenaltyEntry> = BTreeMap::new();
        fn entry(entries: &mut BTreeMap<TokenId, PenaltyEntry>, t: TokenId, vocab: usize) -> Option<&mut PenaltyEntry> {
            ((t as usize) < vocab).then(|| entries.entry(t).or_insert(PenaltyEntry { token: t, repetition: 1.0, subtract: 0.0, bias: 0.0 }))
        }
        if params.repetition_penalty != 1.0 {
            for &t in self.prompt.iter().chain(self.output.keys()) {
                if let Some(e) = entry(&mut entries, t, vocab) {
                    e.repetition = params.repetition_penalty;
                }
            }
        }
        if params.frequency_penalty != 0.0 || params.presence_penalty != 0.0 {
            for (&t, &c) in &self.output {
                if let Some(e) = entry(&mut entries, t, vocab) {
                    e.subtract = params.frequency_penalty * c as f32 + params.presence_penalty;
                }
            }
        }
        let mut biased = std::collections::HashSet::new();
        for &(t, bias) in &params.logit_bias {
            if !biased.insert(t) {
                return None;
            }
            if let Some(e) = entry(&mut entries, t, vocab) {
                e.bias = bias;
            }
        }
        Some(entries.into_values().collect())
    }
}

/// The device-sampling row of a request sampled under `params`, drawing
/// `uniform`, with its penalty entries at `penalties` (`start..end`).
pub fn row_sampling(params: &SamplingParams, uniform: f64, penalties: (u32, u32)) -> RowSampling {
    RowSampling {
        temperature: params.temperature,
        top_k: params.top_k.max(0) as u32,
        top_p: params.top_p,
        min_p: params.min_p,
        uniform,
        num_logprobs: params.logprobs.unwrap_or(0) as u32,
        logprob: params.needs_sampled_logprobs(),
        penalties,
    }
}

/// What a device sampler returns for `row` of a
/// [`ForwardBatch::sampling`](vellum_base::ForwardBatch::sampling) (its
/// penalty entries given), computed here: the host's reference for that
/// contract, the same token [`sample`] draws from the same uniform number.
pub fn sample_row(logits: &[f32], row: &RowSampling, entries: &[PenaltyEntry]) -> DeviceSample {
    let k = row.num_logprobs as usize;
    let lse = if row.logprob || k > 0 { log_sum_exp(logits) } else { f64::NAN };
    let top_logprobs = if k > 0 { top_k(logits, k).into_iter().map(|(t, x)| (t, logprob(x, lse))).collect() } else { Vec::new() };
    let penalized;
    let scores = if entries.is_empty() {
        logits
    } else {
        let mut l = logits.to_vec();
        for e in entries {
            if let Some(x) = l.get_mut(e.token as usize) {
                *x = e.apply(*x);
            }
        }
        penalized = l;
        &penalized[..]
    };
    let token = if row.temperature > 0.0 {
        let params = SamplingParams {
            temperature: row.temperature,
            top_k: i32::try_from(row.top_k).unwrap_or(i32::MAX),
            top_p: row.top_p,
            min_p: row.min_p,
            ..SamplingParams::default()
        };
        draw(scores, &params, row.uniform, None)
    } else {
        argmax(scores)
    };
    let logprob = if row.logprob { logprob(logits[token as usize], lse) } else { f32::NAN };
    DeviceSample { token, logprob, top_logprobs }
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
    let stats = RowStats::new(logits, params, num_logprobs, false);
    sample_masked(logits, &stats, params, rng, num_logprobs, history, None)
}

/// The tokens a structured-output constraint allows: calls `f(token)` for
/// each, in increasing order.
pub type AllowedTokens<'a> = &'a dyn Fn(&mut dyn FnMut(usize));

/// [`sample`] with the row's [`RowStats`] already computed (for these
/// `params`, at least `num_logprobs` top entries, `constrained` exactly when
/// `allowed` is given), restricted to the tokens `allowed` lists (a
/// structured-output constraint): every other logit counts as −∞. The
/// reported log-probabilities stay the model's own.
pub fn sample_masked(
    logits: &[f32],
    stats: &RowStats,
    params: &SamplingParams,
    rng: &mut SeededRng,
    num_logprobs: usize,
    history: (&[TokenId], &[TokenId]),
    allowed: Option<AllowedTokens<'_>>,
) -> Sample {
    // The ranking of the logprobs is that of the logits: only the entries
    // asked for (and the chosen one) are normalized.
    let lse = stats.lse;
    let recomputed;
    let top = if stats.top.len() >= num_logprobs.max(1) {
        &stats.top
    } else {
        recomputed = top_k(logits, num_logprobs.max(1));
        &recomputed
    };
    let mut top_logprobs: Vec<(TokenId, f32)> = top.iter().map(|&(t, x)| (t, logprob(x, lse))).collect();
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
                let plain = stats.plain_draw.as_ref().filter(|_| scores.as_ptr() == logits.as_ptr());
                draw(scores, params, rng.uniform(), plain)
            }
        }
    };
    top_logprobs.truncate(num_logprobs);
    Sample { token, logprob: logprob(logits[token as usize], lse), top_logprobs }
}

/// Up to this many top entries come from [`vector::top_k`] (one vector pass
/// with sorted inserts) instead of a selection over every id.
const FAST_TOP: usize = 64;

/// Draws a token at `u ∈ [0, 1)` (one uniform number of the request's
/// generator). Only the candidates the filters can keep are sorted: the
/// top `k`, or for top-p / min-p alone a prefix of the ranking grown until
/// the cut falls inside it; with no filter the draw walks the weights'
/// chunk sums, then one chunk, in id order (`plain`: those sums, if the
/// caller has them for `logits` and `params`). Weights are
/// [`vector::weight`] everywhere, so a seeded draw is the same on every CPU.
fn draw(logits: &[f32], params: &SamplingParams, u: f64, plain: Option<&PlainDraw>) -> TokenId {
    let v = logits.len();
    let k = if params.top_k > 0 { (params.top_k as usize).min(v) } else { v };
    if k == v && params.top_p >= 1.0 && params.min_p <= 0.0 {
        let computed;
        let plain = match plain {
            Some(p) => p,
            None => {
                let (max, inv_t) = (vector::max(logits), 1.0 / params.temperature);
                let mut sums = Vec::new();
                vector::exp_sums(logits, max, inv_t, &mut sums);
                computed = PlainDraw { max, inv_t, sums };
                &computed
            }
        };
        return draw_plain(logits, plain, u);
    }
    let m = vector::max(logits);
    let inv_t = 1.0 / params.temperature;
    let weight = |x: f32| f64::from(vector::weight(x, m, inv_t));
    // Ranking: larger logit first, lower id on ties.
    let desc = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    let z_full = if k == v {
        let mut sums = Vec::new();
        vector::exp_sums(logits, m, inv_t, &mut sums);
        sums.iter().sum::<f64>()
    } else {
        0.0
    };
    let mut take = if k < v { k } else { 64.min(v) };
    // Every id, partially ordered by the selections so far; built only
    // when a prefix longer than FAST_TOP is needed.
    let mut all: Vec<u32> = Vec::new();
    let mut order: Vec<u32>;
    loop {
        order = if take <= FAST_TOP && take < v && all.is_empty() {
            // A small top-k, or the first prefix: one vector pass.
            vector::top_k(logits, take).into_iter().map(|(t, _)| t).collect()
        } else {
            if all.is_empty() {
                all = (0..v as u32).collect();
            }
            if take < v {
                all.select_nth_unstable_by(take - 1, desc);
            }
            all[..take].sort_unstable_by(desc);
            all[..take].to_vec()
        };
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
    let mut u = u * total;
    for (i, p) in probs.iter().enumerate() {
        if u < *p {
            return cand[i];
        }
        u -= p;
    }
    cand[probs.len() - 1]
}

/// The token at `u ∈ [0, 1)` of the cumulative weights: the chunk whose sum
/// covers `u · total`, then the entry inside it. Rounding can leave the
/// walk past the end (the chunk sums add in another order than the walk):
/// then the last entry of positive weight wins.
fn draw_plain(logits: &[f32], p: &PlainDraw, u: f64) -> TokenId {
    let total: f64 = p.sums.iter().sum();
    if !(total > 0.0 && total.is_finite()) {
        return argmax(logits);
    }
    let mut u = u * total;
    let mut last = None;
    for (c, &s) in p.sums.iter().enumerate() {
        if s <= 0.0 {
            continue;
        }
        last = Some(c);
        if u >= s {
            u -= s;
            continue;
        }
        return walk_chunk(logits, p, c, u);
    }
    match last {
        Some(c) => walk_chunk(logits, p, c, f64::INFINITY),
        None => argmax(logits),
    }
}

/// The entry of chunk `c` at `u` of its cumulative weights (or its last
/// entry of positive weight).
fn walk_chunk(logits: &[f32], p: &PlainDraw, c: usize, mut u: f64) -> TokenId {
    let start = c * vector::CHUNK;
    let chunk = &logits[start..(start + vector::CHUNK).min(logits.len())];
    let mut last = 0;
    for (i, &x) in chunk.iter().enumerate() {
        let w = f64::from(vector::weight(x, p.max, p.inv_t));
        if w > 0.0 {
            if u < w {
                return (start + i) as TokenId;
            }
            u -= w;
            last = i;
        }
    }
    (start + last) as TokenId
}

fn argmax(v: &[f32]) -> TokenId {
    top_k(v, 1).first().map_or(0, |t| t.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_penalty_history_kept_token_by_token_gives_the_entries_of_the_whole_history() {
        let params = SamplingParams {
            repetition_penalty: 1.2,
            frequency_penalty: 0.3,
            presence_penalty: 0.1,
            logit_bias: vec![(7, 1.5), (40, -2.0)],
            ..SamplingParams::greedy(1)
        };
        let mut rng = SeededRng::new(4);
        let prompt: Vec<TokenId> = (0..50).map(|_| rng.below(30) as TokenId).collect();
        let mut output = Vec::new();
        let mut history = PenaltyHistory::new(&prompt, &[]);
        for _ in 0..40 {
            let t = rng.below(45) as TokenId;
            output.push(t);
            history.push(t);
            let want = penalty_entries(&params, &prompt, &output, 42).expect("no duplicate bias");
            assert_eq!(history.entries(&params, 42), Some(want.clone()));
            // What the host applies, entry by entry.
            let mut logits: Vec<f32> = (0..42).map(|i| i as f32 * 0.37 - 7.0).collect();
            let mut by_entries = logits.clone();
            apply_penalties(&mut logits, &params, &prompt, &output);
            for e in &want {
                by_entries[e.token as usize] = e.apply(by_entries[e.token as usize]);
            }
            assert_eq!(logits, by_entries);
        }
        assert!(PenaltyHistory::default().entries(&SamplingParams { logit_bias: vec![(1, 1.0), (1, 2.0)], ..params }, 42).is_none());
    }

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

    /// The normalizing pass runs only for requests that want logprobs:
    /// a greedy row without them reports NaN (the engine then reports
    /// none), with `logprobs: Some(0)` the chosen token's exact logprob;
    /// both choose the same token.
    #[test]
    fn the_normalizer_is_computed_only_when_logprobs_are_wanted() {
        let logits: Vec<f32> = (0..3 * vector::CHUNK).map(|i| ((i * 7919) % 1000) as f32 / 100.0).collect();
        let (plain, asked) = (SamplingParams::greedy(1), SamplingParams { logprobs: Some(0), ..SamplingParams::greedy(1) });
        assert!(!plain.needs_sampled_logprobs() && asked.needs_sampled_logprobs());
        let mut rng = SeededRng::new(1);
        let a = sample(&logits, &plain, &mut rng, 0, (&[], &[]));
        let b = sample(&logits, &asked, &mut rng, 0, (&[], &[]));
        assert_eq!(a.token, b.token);
        assert!(a.logprob.is_nan());
        let exact = logits[b.token as usize] as f64 - logits.iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
        assert!((b.logprob as f64 - exact).abs() < 1e-5, "{} vs {exact}", b.logprob);
        // A plain draw at temperature 1 has the sums anyway and keeps them.
        let t1 = SamplingParams { temperature: 1.0, ..SamplingParams::default() };
        assert!(!RowStats::new(&logits, &t1, 0, false).lse.is_nan());
    }

    /// A draw with no filter walks chunk sums then one chunk: its
    /// frequencies follow the softmax at the temperature over a vocabulary
    /// of several chunks, and the precomputed and on-the-spot sums draw the
    /// same tokens from the same seed.
    #[test]
    fn plain_draws_follow_the_softmax_across_chunks() {
        // Mass on a few tokens in different chunks, the rest spread thin.
        let mut logits = vec![-4.0f32; 3 * vector::CHUNK + 100];
        for (t, x) in [(5usize, 2.0f32), (1500, 1.0), (2047, 2.5), (3100, 0.0)] {
            logits[t] = x;
        }
        for temperature in [1.0f32, 0.7] {
            let params = SamplingParams { temperature, ..SamplingParams::default() };
            let stats = RowStats::new(&logits, &params, 0, false);
            assert!(stats.plain_draw.is_some());
            let w: Vec<f64> = logits.iter().map(|&x| ((x - 2.5) as f64 / temperature as f64).exp()).collect();
            let z: f64 = w.iter().sum();
            let n = 100_000;
            let mut counts = vec![0u32; logits.len()];
            let (mut a, mut b) = (SeededRng::new(11), SeededRng::new(11));
            for _ in 0..n {
                let t = sample_masked(&logits, &stats, &params, &mut a, 0, (&[], &[]), None).token;
                assert_eq!(t, draw(&logits, &params, b.uniform(), None), "precomputed and fresh sums disagree");
                counts[t as usize] += 1;
            }
            for t in [5usize, 1500, 2047, 3100, 0, 3000] {
                let p = w[t] / z;
                let f = counts[t] as f64 / n as f64;
                // Five standard deviations of a binomial frequency.
                let tol = 5.0 * (p * (1.0 - p) / n as f64).sqrt() + 1e-5;
                assert!((f - p).abs() < tol, "t = {temperature}: token {t} drawn {f:.5}, probability {p:.5}");
            }
            let rest: f64 = (0..logits.len()).filter(|t| ![5, 1500, 2047, 3100].contains(t)).map(|t| w[t] / z).sum();
            let seen: u32 = (0..logits.len()).filter(|t| ![5, 1500, 2047, 3100].contains(t)).map(|t| counts[t]).sum();
            let f = seen as f64 / n as f64;
            assert!((f - rest).abs() < 5.0 * (rest * (1.0 - rest) / n as f64).sqrt(), "the thin tail: {f:.5} vs {rest:.5}");
        }
    }

    /// The filters on a large vocabulary (where only a prefix of the ranking
    /// is sorted) keep exactly the set a full sort keeps.
    #[test]
    fn filters_on_a_large_vocabulary_match_a_full_sort() {
        let mut rng = SeededRng::new(9);
        let spread: Vec<f32> = (0..5000).map(|_| (rng.uniform() * 12.0) as f32).collect();
        // Twenty tokens hold ~95% of the mass: the cuts fall inside the
        // first 64-entry prefix (the vector path), not past it.
        let mut peaked = spread.clone();
        for i in 0..20 {
            peaked[i * 211 + 7] += 6.0;
        }
        let t = 0.7f64;
        let cases = [
            (&spread, 0, 0.9f32, 0.0f32),
            (&spread, 0, 1.0, 0.05),
            (&spread, 0, 0.5, 0.01),
            (&spread, 40, 1.0, 0.0),
            (&peaked, 0, 0.9, 0.0),
            (&peaked, 0, 1.0, 0.2),
            (&peaked, 10, 0.95, 0.0),
        ];
        for (logits, top_k, top_p, min_p) in cases {
            let mut order: Vec<usize> = (0..logits.len()).collect();
            order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
            let kept = if top_k > 0 { &order[..top_k] } else { &order[..] };
            let w: Vec<f64> = logits.iter().map(|&x| ((x as f64 - logits[order[0]] as f64) / t).exp()).collect();
            let z: f64 = kept.iter().map(|&i| w[i]).sum();
            // Brute force: the allowed set from the full ranking.
            let mut allowed = std::collections::HashSet::new();
            let mut acc = 0.0;
            for &i in kept {
                let p = w[i] / z;
                if (min_p > 0.0 && p < min_p as f64 * w[order[0]] / z) || (top_p < 1.0 && acc >= top_p as f64) {
                    break;
                }
                allowed.insert(i as TokenId);
                acc += p;
            }
            let params = SamplingParams { temperature: t as f32, top_k: top_k as i32, top_p, min_p, ..SamplingParams::default() };
            let mut seen = std::collections::HashSet::new();
            for _ in 0..3000 {
                let tok = draw(logits, &params, rng.uniform(), None);
                assert!(allowed.contains(&tok), "top_k {top_k} top_p {top_p} min_p {min_p}: {tok} is excluded");
                seen.insert(tok);
            }
            assert!(
                seen.len() > allowed.len() / 2,
                "top_k {top_k} top_p {top_p} min_p {min_p}: the allowed set is sampled ({} of {})",
                seen.len(),
                allowed.len()
            );
        }
    }
}
