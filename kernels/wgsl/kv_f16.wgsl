// KV pool words for an f16 cache: two elements per word, the lower index in
// the low half.
alias KvWord = u32;
const KV_PER_WORD: u32 = 2u;

fn kv_unpack(w: u32, i: u32) -> f32 {
    let v = unpack2x16float(w);
    return select(v.x, v.y, i == 1u);
}

// The word of four consecutive elements: here the first two.
fn kv_pack(x: vec4<f32>) -> u32 {
    return pack2x16float(x.xy);
}

alias KvWord4 = vec2<u32>;

fn kv_unpack4(w: vec2<u32>) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
}
