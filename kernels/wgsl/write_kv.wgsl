// The paper's fused reshape-and-block-write (§5.1): the new tokens' K and V
// ([tokens, kv_heads · head_dim]) go to their slots of the layer's pools
// [num_blocks, block_size, kv_heads, head_dim] through the slot mapping
// (slot = block · block_size + offset), multiplied by the inverse of the
// layer's scales (1 but for FP8). One invocation per pool word; the KV
// element format (kv_*.wgsl) is included before this file.

struct Params {
    tokens: u32,
    row: u32,      // elements per token: kv_heads · head_dim (a multiple of 4)
    slots: u32,    // offset of the slot mapping in `step`
    _pad: u32,
    k_inv: f32,
    v_inv: f32,
    _pad1: u32,
    _pad2: u32,
}

// The word's four elements from `src` (those past KV_PER_WORD repeat the
// last, never read past the word).
fn word_of_k(src: u32) -> vec4<f32> {
    let n = KV_PER_WORD - 1u;
    return vec4<f32>(k[src], k[src + min(1u, n)], k[src + min(2u, n)], k[src + min(3u, n)]);
}

fn word_of_v(src: u32) -> vec4<f32> {
    let n = KV_PER_WORD - 1u;
    return vec4<f32>(v[src], v[src + min(1u, n)], v[src + min(2u, n)], v[src + min(3u, n)]);
}

@group(0) @binding(0) var<storage, read> k: array<f32>;
@group(0) @binding(1) var<storage, read> v: array<f32>;
@group(0) @binding(2) var<storage, read_write> k_pool: array<KvWord>;
@group(0) @binding(3) var<storage, read_write> v_pool: array<KvWord>;
@group(0) @binding(4) var<storage, read> step: array<u32>;
@group(0) @binding(5) var<uniform> p: Params;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 64u;
    let words = p.row / KV_PER_WORD;
    if (i >= p.tokens * words) {
        return;
    }
    let t = i / words;
    let j = i % words;
    let src = t * p.row + j * KV_PER_WORD;
    let dst = step[p.slots + t] * words + j;
    // Unscaled caches store the inputs themselves (no multiply that a device
    // flushing subnormals could change).
    let kw = word_of_k(src);
    let vw = word_of_v(src);
    k_pool[dst] = kv_pack(select(kw * p.k_inv, kw, p.k_inv == 1.0));
    v_pool[dst] = kv_pack(select(vw * p.v_inv, vw, p.v_inv == 1.0));
}
