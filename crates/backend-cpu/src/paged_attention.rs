//! Paged attention on the host (placeholder: plain loops).

use crate::kv_cache::{KvCacheLayout, LayerKvCache};
use vellum_core::AttentionMetadata;

/// Writes new K/V rows into their slots.
pub fn write_kv(cache: &mut LayerKvCache, layout: &KvCacheLayout, k: &[f32], v: &[f32], slot_mapping: &[u32]) {
    let w = layout.num_kv_heads * layout.head_dim;
    for (t, &slot) in slot_mapping.iter().enumerate() {
        let d = slot as usize * w;
        cache.k[d..d + w].copy_from_slice(&k[t * w..(t + 1) * w]);
        cache.v[d..d + w].copy_from_slice(&v[t * w..(t + 1) * w]);
    }
}

/// Causal attention of each query row over its sequence's paged context.
pub fn paged_attention(out: &mut [f32], q: &[f32], cache: &LayerKvCache, layout: &KvCacheLayout, meta: &AttentionMetadata<'_>, num_heads: usize, scale: f32) {
    let (hd, kvh, bs) = (layout.head_dim, layout.num_kv_heads, layout.block_size);
    let group = num_heads / kvh;
    for s in 0..meta.query_start_loc.len() - 1 {
        let (qs, qe) = (meta.query_start_loc[s] as usize, meta.query_start_loc[s + 1] as usize);
        let ctx = meta.context_lens[s] as usize;
        let table = &meta.block_tables[s * meta.block_table_stride..];
        for (i, row) in (qs..qe).enumerate() {
            let pos = ctx - (qe - qs) + i;
            for h in 0..num_heads {
                let kh = h / group;
                let qv = &q[(row * num_heads + h) * hd..][..hd];
                let mut scores = Vec::with_capacity(pos + 1);
                for p in 0..=pos {
                    let slot = table[p / bs] as usize * bs + p % bs;
                    let kv = &cache.k[(slot * kvh + kh) * hd..][..hd];
                    scores.push(qv.iter().zip(kv).map(|(a, b)| a * b).sum::<f32>() * scale);
                }
                let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0;
                for x in scores.iter_mut() {
                    *x = (*x - m).exp();
                    sum += *x;
                }
                let o = &mut out[(row * num_heads + h) * hd..][..hd];
                o.iter_mut().for_each(|x| *x = 0.0);
                for (p, w) in scores.iter().enumerate() {
                    let slot = table[p / bs] as usize * bs + p % bs;
                    let vv = &cache.v[(slot * kvh + kh) * hd..][..hd];
                    for (x, y) in o.iter_mut().zip(vv) {
                        *x += w / sum * y;
                    }
                }
            }
        }
    }
}
