// Paged attention over a mixed batch (prefill chunks and decodes in one
// dispatch), read through block tables: one workgroup per (query token,
// head). Token t belongs to sequence s = token_seq[t]; its query sits at
// position context_lens[s] - q_len + (t - query_start_loc[s]) and attends
// causally to the cached positions before it (the last `window` of them
// with a sliding window). Keys are visited in tiles of 64, one per
// invocation for the scores; an online softmax (running max m and sum l)
// rescales the accumulated values. For the values, invocation `lid` owns
// the four dims 4·(lid % C) .. of the C = head_dim / 4 chunks and the keys
// j ≡ lid / C (mod 64 / C) of each tile; the partial sums meet at the end.
// Grouped-query attention: head h reads kv head h / (num_heads / num_kv_heads).
// The KV element format (kv_*.wgsl) is included before this file; the
// pools are read four elements at a time (head_dim is a multiple of 4).

struct Params {
    tokens: u32,
    num_heads: u32,
    num_kv_heads: u32,
    head_dim: u32,
    block_size: u32,
    stride: u32,      // entries per block-table row
    window: u32,      // 0 = full causal attention
    token_seq: u32,   // offsets into `step`
    qsl: u32,
    ctx: u32,
    tables: u32,
    _pad: u32,
    scale: f32,       // the layer's key scale folded in
    softcap: f32,     // 0 = none
    v_scale: f32,     // the layer's value scale (1 but for FP8)
    _pad2: u32,
}

@group(0) @binding(0) var<storage, read> q: array<f32>;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;
@group(0) @binding(2) var<storage, read> k_pool: array<KvWord4>;
@group(0) @binding(3) var<storage, read> v_pool: array<KvWord4>;
@group(0) @binding(4) var<storage, read> step: array<u32>;
@group(0) @binding(5) var<uniform> p: Params;

const NEG: f32 = -3.0e38;
var<workgroup> qs: array<vec4<f32>, 64>;
var<workgroup> sc: array<f32, 64>;
var<workgroup> base: array<u32, 64>;
var<workgroup> red: array<f32, 64>;
var<workgroup> part: array<vec4<f32>, 64>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let item = wg.x + wg.y * nwg.x;
    if (item >= p.tokens * p.num_heads) {
        return;
    }
    let t = item / p.num_heads;
    let h = item % p.num_heads;
    let s = step[p.token_seq + t];
    let q0 = step[p.qsl + s];
    let q_len = step[p.qsl + s + 1u] - q0;
    let n_ctx = step[p.ctx + s] - q_len + (t - q0) + 1u;
    var first = 0u;
    if (p.window > 0u && n_ctx > p.window) {
        first = n_ctx - p.window;
    }
    let kvh = h / (p.num_heads / p.num_kv_heads);
    let row4 = p.num_kv_heads * p.head_dim / 4u;
    let chunks = p.head_dim / 4u;
    let groups = 64u / chunks;
    let chunk = lid % chunks;
    let group = lid / chunks;
    let q_base = (t * p.num_heads + h) * p.head_dim;
    if (lid < chunks) {
        qs[lid] = vec4<f32>(q[q_base + 4u * lid], q[q_base + 4u * lid + 1u], q[q_base + 4u * lid + 2u], q[q_base + 4u * lid + 3u]);
    }
    workgroupBarrier();

    var m = NEG;
    var l = 0.0;
    var acc = vec4<f32>(0.0);
    for (var t0 = first; t0 < n_ctx; t0 += 64u) {
        // 1. One key per invocation: s_j = scale · q·k_j (soft-capped).
        let j = t0 + lid;
        var s_j = NEG;
        if (j < n_ctx) {
            let blk = step[p.tables + s * p.stride + j / p.block_size];
            let b = (blk * p.block_size + j % p.block_size) * row4 + kvh * chunks;
            base[lid] = b;
            var d4 = vec4<f32>(0.0);
            for (var c = 0u; c < chunks; c++) {
                d4 += qs[c] * kv_unpack4(k_pool[b + c]);
            }
            s_j = (d4.x + d4.y + d4.z + d4.w) * p.scale;
            if (p.softcap > 0.0) {
                s_j = p.softcap * tanh(s_j / p.softcap);
            }
        }
        // 2. The tile's max, then its exponentials and their sum.
        red[lid] = s_j;
        workgroupBarrier();
        for (var off = 32u; off > 0u; off >>= 1u) {
            if (lid < off) {
                red[lid] = max(red[lid], red[lid + off]);
            }
            workgroupBarrier();
        }
        let m_new = max(m, red[0]);
        workgroupBarrier();
        var pj = 0.0;
        if (j < n_ctx) {
            pj = exp(s_j - m_new);
        }
        sc[lid] = pj;
        red[lid] = pj;
        workgroupBarrier();
        for (var off = 32u; off > 0u; off >>= 1u) {
            if (lid < off) {
                red[lid] += red[lid + off];
            }
            workgroupBarrier();
        }
        let alpha = exp(m - m_new);
        l = l * alpha + red[0];
        m = m_new;
        // 3. Rescale and accumulate this invocation's keys of the tile.
        acc *= alpha;
        if (group < groups) {
            let tile = min(64u, n_ctx - t0);
            for (var jj = group; jj < tile; jj += groups) {
                acc += sc[jj] * kv_unpack4(v_pool[base[jj] + chunk]);
            }
        }
        workgroupBarrier();
    }
    // 4. Sum the key groups' partial values.
    part[lid] = acc;
    workgroupBarrier();
    if (lid < chunks) {
        var v = vec4<f32>(0.0);
        for (var g = 0u; g < groups; g++) {
            v += part[g * chunks + lid];
        }
        v /= l;
        if (p.v_scale != 1.0) {
            v *= p.v_scale;
        }
        out[q_base + 4u * lid] = v.x;
        out[q_base + 4u * lid + 1u] = v.y;
        out[q_base + 4u * lid + 2u] = v.z;
        out[q_base + 4u * lid + 3u] = v.w;
    }
}
