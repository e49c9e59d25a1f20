//! A batch for the attention kernels' host tests (`flash_on_host.rs`,
//! `paged_on_host.rs`): random keys and values stored in a KV pool of the
//! case's element type through shuffled block tables, random queries, and
//! the float64 reference of one query head's output.

use vellum_backend_cuda::launch::PoolDtype;
use vellum_base::SeededRng;

/// One batch: its shape and its sequences.
pub struct Case {
    pub head_dim: usize,
    /// Tokens a KV block.
    pub block: usize,
    pub dtype: PoolDtype,
    pub heads: usize,
    pub kv_heads: usize,
    pub window: usize,
    pub softcap: f32,
    /// (context after the step, query tokens) of each sequence.
    pub seqs: Vec<(usize, usize)>,
    /// Extra tile slots past the batch's tiles (a graph's flash launch).
    #[allow(dead_code)] // flash_on_host.rs reads it
    pub extra_slots: usize,
}

/// What the kernels read (the pools as stored, the tables, the queries, the
/// batch's metadata) and the values the reference reads back.
pub struct Batch {
    /// Block-table entries per sequence.
    pub max_blocks: usize,
    /// `[seqs][max_blocks]`, physical ids shuffled over a pool with spares.
    pub tables: Vec<i32>,
    /// The pools' bytes (`[blocks][block][kv_heads][head_dim]`, the case's
    /// element type; FP8 as codes of value / scale).
    pub k_pool: Vec<u8>,
    pub v_pool: Vec<u8>,
    /// Per sequence, `[position][kv_heads · head_dim]` as stored, in f32
    /// (FP8 times its scale).
    pub keys: Vec<Vec<f32>>,
    pub values: Vec<Vec<f32>>,
    /// `[tokens][heads][head_dim]`.
    pub q: Vec<f32>,
    /// Query start offsets (`seqs + 1`) and contexts after the step.
    pub qsl: Vec<i32>,
    pub ctx: Vec<i32>,
    pub num_tokens: usize,
    /// FP8's layer scales (1 for other types).
    pub k_scale: f32,
    pub v_scale: f32,
}

/// A value stored in the cache: its bits (little-endian) and the value
/// attention reads back (times the scale).
fn store(x: f32, dtype: PoolDtype, scale: f32) -> (Vec<u8>, f32) {
    match dtype {
        PoolDtype::F32 => (x.to_le_bytes().to_vec(), x),
        PoolDtype::Bf16 => {
            let b = half::bf16::from_f32(x);
            (b.to_le_bytes().to_vec(), b.to_f32())
        }
        PoolDtype::F16 => {
            let h = half::f16::from_f32(x);
            (h.to_le_bytes().to_vec(), h.to_f32())
        }
        PoolDtype::Fp8E4m3 => {
            let c = vellum_base::fp8::from_f32(x / scale);
            (vec![c], vellum_base::fp8::to_f32(c) * scale)
        }
    }
}

impl Batch {
    /// Writes what every attention program reads, one file each: `q`, the
    /// pools `k` and `v` (FP8 as the codes, which the kernels read as
    /// value / 2^8), `tables`, `qsl`, `ctx`.
    pub fn write(&self, dir: &std::path::Path) {
        for (name, data) in [
            ("q", crate::host_cxx::bytes_of(&self.q)),
            ("k", self.k_pool.clone()),
            ("v", self.v_pool.clone()),
            ("tables", crate::host_cxx::bytes_of(&self.tables)),
            ("qsl", crate::host_cxx::bytes_of(&self.qsl)),
            ("ctx", crate::host_cxx::bytes_of(&self.ctx)),
        ] {
            std::fs::write(dir.join(name), data).expect("write an input");
        }
    }
}

impl Case {
    /// The scales as launch.rs passes them: the key scale (and an FP8
    /// code's 2^8) in the score's scale `head_dim^-½`, the soft-cap, the
    /// value scale on the outputs.
    pub fn kernel_scales(&self, b: &Batch) -> [f32; 3] {
        let unit = self.dtype.unit();
        [1.0 / (self.head_dim as f32).sqrt() * b.k_scale * unit, self.softcap, b.v_scale * unit]
    }

    /// Random inputs for this case. Unwritten slots of the pools hold 0x7f
    /// bytes (a bf16/f16 of 3.4e38 or 65k-ish, an f32 of 3.4e38, an FP8
    /// NaN): a kernel that reads one is far off the reference.
    pub fn batch(&self, rng: &mut SeededRng) -> Batch {
        let (d, row) = (self.head_dim, self.kv_heads * self.head_dim);
        let (k_scale, v_scale) = if self.dtype == PoolDtype::Fp8E4m3 { (0.0123f32, 0.007f32) } else { (1.0, 1.0) };
        let block = self.block;
        let blocks_of = |c: usize| c.div_ceil(block);
        let max_blocks = self.seqs.iter().map(|&(c, _)| blocks_of(c)).max().expect("seqs");
        let num_blocks = self.seqs.iter().map(|&(c, _)| blocks_of(c)).sum::<usize>() + 3;
        let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
        rng.shuffle(&mut ids);
        let mut tables = vec![0i32; self.seqs.len() * max_blocks];
        let mut next = 0;
        for (s, &(c, _)) in self.seqs.iter().enumerate() {
            for b in 0..blocks_of(c) {
                tables[s * max_blocks + b] = ids[next];
                next += 1;
            }
        }
        let elem = self.dtype.size();
        let mut k_pool = vec![0x7fu8; num_blocks * block * row * elem];
        let mut v_pool = k_pool.clone();
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        for (s, &(c, _)) in self.seqs.iter().enumerate() {
            let (mut ks, mut vs) = (Vec::new(), Vec::new());
            for pos in 0..c {
                let slot = tables[s * max_blocks + pos / block] as usize * block + pos % block;
                for j in 0..row {
                    // |x| < 1: up to 81 and 143 as FP8 codes of the scales above.
                    let (kb, kv) = store(rng.signed_f32(), self.dtype, k_scale);
                    let (vb, vv) = store(rng.signed_f32(), self.dtype, v_scale);
                    let at = (slot * row + j) * elem;
                    k_pool[at..at + elem].copy_from_slice(&kb);
                    v_pool[at..at + elem].copy_from_slice(&vb);
                    ks.push(kv);
                    vs.push(vv);
                }
            }
            keys.push(ks);
            values.push(vs);
        }
        let num_tokens: usize = self.seqs.iter().map(|&(_, q)| q).sum();
        let q: Vec<f32> = (0..num_tokens * self.heads * d).map(|_| rng.signed_f32()).collect();
        let mut qsl = vec![0i32];
        for &(_, ql) in &self.seqs {
            qsl.push(qsl.last().copied().unwrap_or(0) + ql as i32);
        }
        let ctx: Vec<i32> = self.seqs.iter().map(|&(c, _)| c as i32).collect();
        Batch { max_blocks, tables, k_pool, v_pool, keys, values, q, qsl, ctx, num_tokens, k_scale, v_scale }
    }

    /// The float64 output of query token `i` of sequence `s` at head `h`
    /// (`t`: the token's index in the batch), its query's elements read
    /// through `q_value` (the kernel's rounding of them, if any).
    pub fn reference(&self, b: &Batch, s: usize, i: usize, t: usize, h: usize, q_value: impl Fn(f32) -> f64) -> Vec<f64> {
        let (d, row) = (self.head_dim, self.kv_heads * self.head_dim);
        let (c, ql) = self.seqs[s];
        let n_ctx = c - ql + i + 1;
        let first = if self.window > 0 && n_ctx > self.window { n_ctx - self.window } else { 0 };
        let kvh = h / (self.heads / self.kv_heads);
        let scale = 1.0 / (d as f64).sqrt();
        let qv: Vec<f64> = b.q[(t * self.heads + h) * d..(t * self.heads + h + 1) * d].iter().map(|&x| q_value(x)).collect();
        let scores: Vec<f64> = (first..n_ctx)
            .map(|pos| {
                let kr = &b.keys[s][pos * row + kvh * d..pos * row + (kvh + 1) * d];
                let dot = qv.iter().zip(kr).map(|(a, &k)| a * f64::from(k)).sum::<f64>() * scale;
                if self.softcap > 0.0 {
                    f64::from(self.softcap) * (dot / f64::from(self.softcap)).tanh()
                } else {
                    dot
                }
            })
            .collect();
        let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let total: f64 = scores.iter().map(|x| (x - m).exp()).sum();
        (0..d)
            .map(|e| {
                (first..n_ctx)
                    .enumerate()
                    .map(|(j, pos)| (scores[j] - m).exp() / total * f64::from(b.values[s][pos * row + kvh * d + e]))
                    .sum()
            })
            .collect()
    }
}
