// Weight access for GGML Q4_1 blocks (32 values: f16 d, f16 m, 16 bytes of
// nibbles; value j is the low nibble of byte j, value j + 16 its high
// nibble; w = q·d + m). A block is 5 words, exactly GGUF's bytes, stored
// [K/32, N] (block (b, n) at word (b * wn + n) * 5) so that neighbouring
// columns read neighbouring blocks. Q4_0 files arrive here too, as m = -8·d.

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
    let base = ((k / 32u) * p.wn + n) * 5u;
    let dm = unpack2x16float(w[base]);
    let e = k % 32u;
    let j = e % 16u;
    let byte = (w[base + 1u + j / 4u] >> (8u * (j % 4u))) & 0xffu;
    let q = select(byte & 0xfu, byte >> 4u, e >= 16u);
    return f32(q) * dm.x + dm.y;
}

// The four low (`shift` 0) or high (`shift` 4) nibbles of a word.
fn nibbles(word: u32, shift: u32) -> vec4<f32> {
    return vec4<f32>((vec4<u32>(word, word >> 8u, word >> 16u, word >> 24u) >> vec4<u32>(shift)) & vec4<u32>(0xfu));
}

fn w_decode(b: u32, n: u32) -> WBlock {
    let base = (b * p.wn + n) * 5u;
    let dm = unpack2x16float(w[base]);
    let w0 = w[base + 1u];
    let w1 = w[base + 2u];
    let w2 = w[base + 3u];
    let w3 = w[base + 4u];
    return WBlock(nibbles(w0, 0u), nibbles(w1, 0u), nibbles(w2, 0u), nibbles(w3, 0u),
                  nibbles(w0, 4u), nibbles(w1, 4u), nibbles(w2, 4u), nibbles(w3, 4u), dm.x, dm.y);
}
