// KV pool words for a bf16 cache: two elements per word, the lower index in
// the low half; f32 → bf16 rounds to nearest, ties to even (as the CPU
// backend's `half::bf16::from_f32`), NaN stays NaN.
alias KvWord = u32;
const KV_PER_WORD: u32 = 2u;

fn bf16_bits(v: f32) -> u32 {
    let u = bitcast<u32>(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (u >> 16u) | 0x40u;
    }
    return (u + 0x7fffu + ((u >> 16u) & 1u)) >> 16u;
}

fn kv_unpack(w: u32, i: u32) -> f32 {
    return bitcast<f32>(select(w << 16u, w & 0xffff0000u, i == 1u));
}

// The word of four consecutive elements: here the first two.
fn kv_pack(x: vec4<f32>) -> u32 {
    return bf16_bits(x.x) | (bf16_bits(x.y) << 16u);
}

alias KvWord4 = vec2<u32>;

fn kv_unpack4(w: vec2<u32>) -> vec4<f32> {
    return vec4<f32>(bitcast<f32>(w.x << 16u), bitcast<f32>(w.x & 0xffff0000u), bitcast<f32>(w.y << 16u), bitcast<f32>(w.y & 0xffff0000u));
}
