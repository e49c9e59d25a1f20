//! Beam search (paper §4.4), one step at a time over the engine's view.
//!
//! Every running candidate of a request is scheduled in the same step; each
//! proposes its `2W` best continuations; the best `W` that do not end the
//! sequence go on, those that end it (EOS, a stop token) and rank within the
//! first `W` become finished hypotheses. When `W` hypotheses are finished
//! and no running candidate scores better (length-normalised,
//! [`beam_score`]), the search ends: only this step's finished hypotheses
//! are sent on, and the scheduler stops the rest.

use crate::outputs::beam_score;
use crate::sampler::{log_softmax, top_k};
use crate::sequences::{Draw, ReqView, SeqView};
use vellum_base::{BeamSearchParams, IdMap, SeqId, TokenId};

/// The next step of one beam-search request: `(parent, token)` entries for
/// the scheduler, and one [`Draw`] per entry. `rows` are the request's
/// candidates with their logits row.
pub(crate) fn beam_step(
    req: &ReqView,
    beam: &BeamSearchParams,
    seqs: &IdMap<SeqId, SeqView>,
    rows: &[(SeqId, usize)],
    logits: &[f32],
    vocab: usize,
) -> (Vec<(SeqId, TokenId)>, Vec<Draw>) {
    let w = beam.beam_width;
    let k = req.params.logprobs.unwrap_or(0);
    let stops = &req.stop_token_ids;
    // (score, parent, token, logprob)
    let mut cands: Vec<(f64, SeqId, TokenId, f32)> = Vec::with_capacity(rows.len() * 2 * w);
    let mut tops: IdMap<SeqId, Vec<(TokenId, f32)>> = IdMap::default();
    let mut out_len = 0;
    for &(sid, row) in rows {
        let Some(view) = seqs.get(&sid) else { continue };
        let lp = log_softmax(&logits[row * vocab..(row + 1) * vocab]);
        out_len = view.output().len();
        let may_stop = out_len >= req.params.min_tokens;
        for (tok, l) in top_k(&lp, 2 * w + stops.len()) {
            if !may_stop && stops.contains(&tok) {
                continue;
            }
            cands.push((view.cumulative + l as f64, sid, tok, l));
        }
        if k > 0 {
            tops.insert(sid, top_k(&lp, k));
        }
    }
    cands.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.2.cmp(&b.2)));
    let new_len = out_len + 1;
    let mut finished_scores: Vec<f64> = req
        .seqs
        .iter()
        .filter_map(|s| seqs.get(s))
        .filter(|v| v.finish_reason.is_some())
        .map(|v| beam_score(v.cumulative, v.output().len(), beam.length_penalty))
        .collect();
    let mut next: Vec<(SeqId, TokenId)> = Vec::new();
    let mut draws: Vec<Draw> = Vec::new();
    let mut best_running = f64::NEG_INFINITY;
    let mut num_running = 0;
    for (rank, &(cum, parent, tok, l)) in cands.iter().enumerate() {
        let ends = stops.contains(&tok);
        if (ends && rank >= w) || (!ends && num_running == w) {
            continue;
        }
        if ends {
            finished_scores.push(beam_score(cum, new_len, beam.length_penalty));
        } else {
            num_running += 1;
            best_running = best_running.max(beam_score(cum, new_len, beam.length_penalty));
        }
        next.push((parent, tok));
        draws.push(Draw { token: tok, logprob: l, top: (k > 0).then(|| tops.get(&parent).cloned().unwrap_or_default()), index: None });
        if num_running == w {
            break;
        }
    }
    // Stop once no running candidate can beat the W best finished: only this
    // step's finished hypotheses go on (to be ranked).
    finished_scores.sort_by(|a, b| b.total_cmp(a));
    if finished_scores.len() >= w && finished_scores[w - 1] >= best_running {
        let keep: Vec<bool> = next.iter().map(|(_, t)| stops.contains(t)).collect();
        let mut it = keep.iter();
        next.retain(|_| *it.next().unwrap_or(&false));
        let mut it = keep.iter();
        draws.retain(|_| *it.next().unwrap_or(&false));
    }
    (next, draws)
}
