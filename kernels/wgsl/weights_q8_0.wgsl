// Weight access for GGML Q8_0 blocks (32 values: f16 d, 32 int8; w = q·d),
// repacked to 9 words so that every block is word-aligned: word 0 holds d in
// its low half, words 1..8 the int8 values, four per word, little-endian.
// Stored [K/32, N] like weights_q4_1.wgsl.

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

fn w_elem(n: u32, k: u32) -> f32 {
    let base = ((k / 32u) * p.wn + n) * 9u;
    let d = unpack2x16float(w[base]).x;
    let e = k % 32u;
    let q = extractBits(bitcast<i32>(w[base + 1u + e / 4u]), 8u * (e % 4u), 8u);
    return f32(q) * d;
}

// The four signed bytes of a word, sign-extended by arithmetic shifts.
fn bytes4(word: u32) -> vec4<f32> {
    let v = bitcast<vec4<i32>>(vec4<u32>(word << 24u, word << 16u, word << 8u, word));
    return vec4<f32>(v >> vec4<u32>(24u));
}

fn w_decode(b: u32, n: u32) -> WBlock {
    let base = (b * p.wn + n) * 9u;
    let d = unpack2x16float(w[base]).x;
    return WBlock(bytes4(w[base + 1u]), bytes4(w[base + 2u]), bytes4(w[base + 3u]), bytes4(w[base + 4u]),
                  bytes4(w[base + 5u]), bytes4(w[base + 6u]), bytes4(w[base + 7u]), bytes4(w[base + 8u]), d, 0.0);
}
