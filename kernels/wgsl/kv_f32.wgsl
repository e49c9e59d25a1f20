// KV pool words for an f32 cache: one element per word.
alias KvWord = f32;
const KV_PER_WORD: u32 = 1u;

fn kv_unpack(w: f32, i: u32) -> f32 {
    return w;
}

// The word of four consecutive elements: here the first.
fn kv_pack(x: vec4<f32>) -> f32 {
    return x.x;
}

alias KvWord4 = vec4<f32>;

// Four consecutive elements (the first a multiple of 4) from a vec4 view of
// the pool.
fn kv_unpack4(w: vec4<f32>) -> vec4<f32> {
    return w;
}
