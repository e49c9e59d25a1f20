//! Sampling on the device, host side: a step's [`RowSampling`] rows and
//! their [`PenaltyEntry`] list packed into the flat arrays `sample_rows`
//! (`kernels/cuda/sampling.cu`) reads, checked first, since the kernel
//! indexes them unchecked; and the kernel's outputs read back into
//! [`DeviceSample`]s.

use vellum_base::{DeviceSample, Error, PenaltyEntry, RowSampling};

/// Most top logprobs a row may ask for on the device (the OpenAI API's
/// limit is 20; the kernel lists them from its score bins in two passes
/// over the row, or, where the bins are too full, one pass an entry).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// The kernel's inputs, on the host.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PackedSampling {
    /// Per row: temperature, top-p, min-p, 0.
    pub fparams: Vec<f32>,
    /// Per row: top-k, top logprobs, penalty start, penalty end, wants the logprob.
    pub iparams: Vec<i32>,
    /// Per row: the draw.
    pub uniform: Vec<f64>,
    /// Penalty tokens (at least one entry, unused when no row points at it).
    pub pen_tokens: Vec<i32>,
    /// Penalty values, three an entry.
    pub pen_values: Vec<f32>,
    /// Top entries a row has room for (at least 1).
    pub top_stride: usize,
    /// Whether any row has penalty entries.
    pub any_penalties: bool,
}

/// Packs `rows` for a vocabulary of `vocab`, or says why the batch cannot
/// be sampled on the device: a penalty range outside `penalties`, a row
/// whose entries are not in increasing token order (one per token),
/// parameters out of range, or more top logprobs than [`MAX_TOP_LOGPROBS`].
/// Entries for tokens outside the vocabulary are left out, as the host
/// sampler skips them.
pub fn pack(rows: &[RowSampling], penalties: &[PenaltyEntry], vocab: usize) -> Result<PackedSampling, Error> {
    let bad = |m: String| Error::Backend(format!("device sampling: {m}"));
    i32::try_from(vocab).map_err(|_| bad(format!("a vocabulary of {vocab}")))?;
    let mut p = PackedSampling { top_stride: 1, ..PackedSampling::default() };
    for (i, r) in rows.iter().enumerate() {
        let (start, end) = (r.penalties.0 as usize, r.penalties.1 as usize);
        let Some(entries) = penalties.get(start..end) else {
            return Err(bad(format!("row {i} points at penalty entries {start}..{end} of {}", penalties.len())));
        };
        if entries.windows(2).any(|w| w[0].token >= w[1].token) {
            return Err(bad(format!("row {i}'s penalty entries are not one per token in increasing order")));
        }
        if r.num_logprobs as usize > MAX_TOP_LOGPROBS {
            return Err(bad(format!("row {i} asks for {} top logprobs (at most {MAX_TOP_LOGPROBS})", r.num_logprobs)));
        }
        if !(r.temperature >= 0.0 && r.top_p > 0.0 && r.top_p <= 1.0 && (0.0..=1.0).contains(&r.min_p) && (0.0..1.0).contains(&r.uniform)) {
            return Err(bad(format!("row {i} has parameters out of range: {r:?}")));
        }
        p.top_stride = p.top_stride.max(r.num_logprobs as usize);
        let first = p.pen_tokens.len();
        for e in entries.iter().filter(|e| (e.token as usize) < vocab) {
            p.pen_tokens.push(e.token as i32);
            p.pen_values.extend([e.repetition, e.subtract, e.bias]);
        }
        let last = p.pen_tokens.len();
        p.any_penalties |= last > first;
        p.fparams.extend([r.temperature, r.top_p, r.min_p, 0.0]);
        let top_k = if r.top_k as usize >= vocab { 0 } else { r.top_k as i32 };
        p.iparams.extend([top_k, r.num_logprobs as i32, first as i32, last as i32, i32::from(r.logprob)]);
        p.uniform.push(r.uniform);
    }
    if p.pen_tokens.is_empty() {
        p.pen_tokens.push(0);
        p.pen_values.extend([1.0, 0.0, 0.0]);
    }
    Ok(p)
}

/// The kernel's outputs as samples: `None` if a token lies outside the
/// vocabulary (the kernel's -1 for a row with a NaN), so that the host
/// samples the step. A row's top entries are min(`num_logprobs`, `vocab`).
pub fn unpack(
    rows: &[RowSampling],
    tokens: &[i32],
    logprobs: &[f32],
    top_ids: &[i32],
    top_logprobs: &[f32],
    top_stride: usize,
    vocab: usize,
) -> Option<Vec<DeviceSample>> {
    let mut out = Vec::with_capacity(rows.len());
    for (i, r) in rows.iter().enumerate() {
        let token = u32::try_from(*tokens.get(i)?).ok().filter(|&t| (t as usize) < vocab)?;
        let wanted = (r.num_logprobs as usize).min(vocab);
        let mut top = Vec::with_capacity(wanted);
        for j in 0..wanted {
            let id = u32::try_from(*top_ids.get(i * top_stride + j)?).ok().filter(|&t| (t as usize) < vocab)?;
            top.push((id, *top_logprobs.get(i * top_stride + j)?));
        }
        let logprob = if r.logprob { *logprobs.get(i)? } else { f32::NAN };
        out.push(DeviceSample { token, logprob, top_logprobs: top });
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row() -> RowSampling {
        RowSampling { temperature: 0.8, top_k: 0, top_p: 0.95, min_p: 0.0, uniform: 0.5, num_logprobs: 2, logprob: true, penalties: (0, 0) }
    }

    #[test]
    fn packs_rows_and_penalties_in_the_kernels_layout() {
        let pens = [PenaltyEntry { token: 3, repetition: 1.2, subtract: 0.5, bias: 0.0 }];
        let rows = [RowSampling { penalties: (0, 1), top_k: 50, ..row() }, RowSampling { top_k: 1000, num_logprobs: 5, ..row() }];
        let p = pack(&rows, &pens, 100).expect("valid");
        assert_eq!(p.fparams, [0.8, 0.95, 0.0, 0.0, 0.8, 0.95, 0.0, 0.0]);
        // A top-k at or past the vocabulary is no cut.
        assert_eq!(p.iparams, [50, 2, 0, 1, 1, 0, 5, 1, 1, 1]);
        assert_eq!((p.top_stride, p.any_penalties), (5, true));
        assert_eq!((p.pen_tokens.as_slice(), p.pen_values.as_slice()), (&[3][..], &[1.2, 0.5, 0.0][..]));
        // A token outside the vocabulary is left out (the host skips it too).
        let p =
            pack(&[RowSampling { penalties: (0, 2), ..row() }], &[pens[0], PenaltyEntry { token: 100, ..pens[0] }], 100).expect("valid");
        assert_eq!((&p.pen_tokens[..], &p.iparams[2..4]), (&[3][..], &[0, 1][..]));
        // No entries: one unused entry, so that the buffer exists.
        let p = pack(&[row()], &[], 100).expect("valid");
        assert_eq!((p.pen_tokens.len(), p.any_penalties), (1, false));
    }

    #[test]
    fn refuses_what_the_kernel_would_read_out_of_bounds() {
        let pens = [PenaltyEntry { token: 3, repetition: 1.2, subtract: 0.0, bias: 0.0 }];
        for (rows, pens, why) in [
            (vec![RowSampling { penalties: (0, 2), ..row() }], &pens[..], "penalty entries 0..2 of 1"),
            (vec![RowSampling { penalties: (1, 0), ..row() }], &pens[..], "penalty entries 1..0"),
            (vec![RowSampling { num_logprobs: 21, ..row() }], &[][..], "21 top logprobs"),
            (vec![RowSampling { uniform: 1.0, ..row() }], &[][..], "out of range"),
            (vec![RowSampling { top_p: 0.0, ..row() }], &[][..], "out of range"),
            (vec![RowSampling { penalties: (0, 2), ..row() }], &[pens[0], pens[0]][..], "increasing order"),
        ] {
            let e = pack(&rows, pens, 100).expect_err(why).to_string();
            assert!(e.contains(why), "{e}");
        }
    }

    #[test]
    fn unpacks_tokens_and_refuses_a_token_outside_the_vocabulary() {
        let rows = [row(), RowSampling { logprob: false, num_logprobs: 0, ..row() }];
        let s = unpack(&rows, &[7, 9], &[-0.5, -1.0], &[7, 8, 0, 0], &[-0.5, -0.9, 0.0, 0.0], 2, 10).expect("valid");
        assert_eq!(s[0], DeviceSample { token: 7, logprob: -0.5, top_logprobs: vec![(7, -0.5), (8, -0.9)] });
        assert!(s[1].logprob.is_nan() && s[1].top_logprobs.is_empty() && s[1].token == 9);
        assert!(unpack(&rows, &[7, 10], &[0.0; 2], &[0; 4], &[0.0; 4], 2, 10).is_none());
        assert!(unpack(&rows, &[-1, 9], &[0.0; 2], &[0; 4], &[0.0; 4], 2, 10).is_none());
    }
}
