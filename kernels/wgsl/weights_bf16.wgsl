// Weight access for bf16 weights: as weights_f16.wgsl, each half of a word
// being the high 16 bits of an f32 (widening is exact).

// A decoded block of 32 weights: value e is d · q[e / 4][e % 4] + m, with q0
// holding values 0..3, q1 4..7, … q7 28..31 (named vectors, not an array,
// so that they stay in registers on every compiler).
struct WBlock {
    q0: vec4<f32>, q1: vec4<f32>, q2: vec4<f32>, q3: vec4<f32>,
    q4: vec4<f32>, q5: vec4<f32>, q6: vec4<f32>, q7: vec4<f32>,
    d: f32,
    m: f32,
}

@group(0) @binding(2) var<storage, read> w: array<u32>;

fn bf16_pair(word: u32) -> vec2<f32> {
    return vec2<f32>(bitcast<f32>(word << 16u), bitcast<f32>(word & 0xffff0000u));
}

fn w_pair(n: u32, k: u32) -> vec2<f32> {
    if (k < p.wk) {
        return bf16_pair(w[(k / 2u) * p.wn + n]);
    }
    return vec2<f32>(0.0, 0.0);
}

fn w_elem(n: u32, k: u32) -> f32 {
    let v = bf16_pair(w[(k / 2u) * p.wn + n]);
    return select(v.x, v.y, (k & 1u) == 1u);
}

fn w_vec(n: u32, k: u32) -> vec4<f32> {
    return vec4<f32>(w_pair(n, k), w_pair(n, k + 2u));
}

fn w_decode(b: u32, n: u32) -> WBlock {
    let k = b * 32u;
    return WBlock(w_vec(n, k), w_vec(n, k + 4u), w_vec(n, k + 8u), w_vec(n, k + 12u),
                  w_vec(n, k + 16u), w_vec(n, k + 20u), w_vec(n, k + 24u), w_vec(n, k + 28u), 1.0, 0.0);
}
