// Copy-on-write, batched: block dst ← block src for every (src, dst) pair of
// the list, in one pool (the host dispatches it for every layer's K and V).
// The pool is seen as words, whatever its element type.

struct Params {
    pairs: u32,
    block_words: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<storage, read_write> pool: array<u32>;
@group(0) @binding(1) var<storage, read> list: array<u32>;
@group(0) @binding(2) var<uniform> p: Params;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 64u;
    if (i >= p.pairs * p.block_words) {
        return;
    }
    let pair = i / p.block_words;
    let w = i % p.block_words;
    pool[list[2u * pair + 1u] * p.block_words + w] = pool[list[2u * pair] * p.block_words + w];
}
