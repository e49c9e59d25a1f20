// Weight access for f32 weights, stored transposed as [K, N] (element (n, k)
// at k * wn + n), so that neighbouring invocations (columns n, n + 1) read
// neighbouring words. Included by matmul.wgsl and embed.wgsl, which declare
// `p` with the fields `wn` (rows N of this weight chunk) and `wk` (K).

// A decoded block of 32 weights: value e is d · q[e / 4][e % 4] + m, with q0
// holding values 0..3, q1 4..7, … q7 28..31 (named vectors, not an array,
// so that they stay in registers on every compiler).
struct WBlock {
    q0: vec4<f32>, q1: vec4<f32>, q2: vec4<f32>, q3: vec4<f32>,
    q4: vec4<f32>, q5: vec4<f32>, q6: vec4<f32>, q7: vec4<f32>,
    d: f32,
    m: f32,
}

@group(0) @binding(2) var<storage, read> w: array<f32>;

fn w_elem(n: u32, k: u32) -> f32 {
    return w[k * p.wn + n];
}

fn w_at(n: u32, k: u32) -> f32 {
    if (k < p.wk) {
        return w[k * p.wn + n];
    }
    return 0.0;
}

fn w_vec(n: u32, k: u32) -> vec4<f32> {
    return vec4<f32>(w_at(n, k), w_at(n, k + 1u), w_at(n, k + 2u), w_at(n, k + 3u));
}

// Block b (values 32b .. 32b + 31) of row n; zero past K.
fn w_decode(b: u32, n: u32) -> WBlock {
    let k = b * 32u;
    return WBlock(w_vec(n, k), w_vec(n, k + 4u), w_vec(n, k + 8u), w_vec(n, k + 12u),
                  w_vec(n, k + 16u), w_vec(n, k + 20u), w_vec(n, k + 24u), w_vec(n, k + 28u), 1.0, 0.0);
}
