// y[m, col0 + n] = Σ_k x[m, k] · W[n, k] (+ bias[col0 + n]) for one chunk of
// W's rows (a weight larger than a storage binding is split by rows).
//
// A workgroup computes 256 output columns for TM rows (TM is prepended by
// the host: 1, 4, 8 or 16, the smallest that covers the batch, so a decode
// of one sequence does no wasted work); invocation `lid` owns columns
// lid, lid + 64, lid + 128, lid + 192, so neighbouring invocations read
// neighbouring weight blocks and every staged x value serves four columns.
// The TM × KC slice of x is staged in workgroup memory as vec4s, with the
// sum of each row's 32-value blocks. Each invocation decodes its columns'
// weight blocks (`w_decode` of the weight format, included before this
// file) and, per row, adds d · Σ q·x + m · Σ x — the same sum as
// Σ (d·q + m)·x, with the offset term shared by every column.

struct Params {
    m: u32,        // rows of x and y
    k: u32,        // columns of x
    wn: u32,       // rows of this weight chunk (output columns)
    wk: u32,       // K as the weight stores it
    ldy: u32,      // row stride of y
    col0: u32,     // first output column of this chunk
    has_bias: u32,
    _pad: u32,
}

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
@group(0) @binding(4) var<uniform> p: Params;

// KC (values of K staged per pass, a multiple of 32) is prepended with TM.
const KB: u32 = KC / 32u;   // blocks per pass
var<workgroup> xs: array<vec4<f32>, TM * KC / 4u>;
var<workgroup> xsum: array<f32, TM * KB>;

fn block_dot(blk: WBlock, xb: u32) -> f32 {
    return dot(blk.q0, xs[xb]) + dot(blk.q1, xs[xb + 1u]) + dot(blk.q2, xs[xb + 2u]) + dot(blk.q3, xs[xb + 3u])
         + dot(blk.q4, xs[xb + 4u]) + dot(blk.q5, xs[xb + 5u]) + dot(blk.q6, xs[xb + 6u]) + dot(blk.q7, xs[xb + 7u]);
}

// Column c of the invocation, clamped into the chunk (a clamped column
// computes a duplicate that is not stored).
fn column(wgx: u32, lid: u32, c: u32) -> u32 {
    return min(wgx * 256u + lid + 64u * c, p.wn - 1u);
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let m0 = wg.y * TM;
    let n0 = column(wg.x, lid, 0u);
    let n1 = column(wg.x, lid, 1u);
    let n2 = column(wg.x, lid, 2u);
    let n3 = column(wg.x, lid, 3u);
    var acc: array<vec4<f32>, TM>;
    for (var k0 = 0u; k0 < p.k; k0 += KC) {
        for (var i = lid; i < TM * KC / 4u; i += 64u) {
            let r = i / (KC / 4u);
            let kk = k0 + (i % (KC / 4u)) * 4u;
            var v = vec4<f32>(0.0);
            if (m0 + r < p.m) {
                let base = (m0 + r) * p.k;
                for (var c = 0u; c < 4u; c++) {
                    if (kk + c < p.k) {
                        v[c] = x[base + kk + c];
                    }
                }
            }
            xs[i] = v;
        }
        workgroupBarrier();
        for (var i = lid; i < TM * KB; i += 64u) {
            let xb = (i / KB) * (KC / 4u) + (i % KB) * 8u;
            var s = vec4<f32>(0.0);
            for (var j = 0u; j < 8u; j++) {
                s += xs[xb + j];
            }
            xsum[i] = s.x + s.y + s.z + s.w;
        }
        workgroupBarrier();
        let nb = (min(KC, p.k - k0) + 31u) / 32u;
        for (var bi = 0u; bi < nb; bi++) {
            let b = k0 / 32u + bi;
            let w0 = w_decode(b, n0);
            let w1 = w_decode(b, n1);
            let w2 = w_decode(b, n2);
            let w3 = w_decode(b, n3);
            let d = vec4<f32>(w0.d, w1.d, w2.d, w3.d);
            let m = vec4<f32>(w0.m, w1.m, w2.m, w3.m);
            for (var r = 0u; r < TM; r++) {
                let xb = r * (KC / 4u) + bi * 8u;
                let dots = vec4<f32>(block_dot(w0, xb), block_dot(w1, xb), block_dot(w2, xb), block_dot(w3, xb));
                acc[r] += d * dots + m * xsum[r * KB + bi];
            }
        }
        workgroupBarrier();
    }
    for (var c = 0u; c < 4u; c++) {
        let n = wg.x * 256u + lid + 64u * c;
        if (n < p.wn) {
            var b = 0.0;
            if (p.has_bias != 0u) {
                b = bias[p.col0 + n];
            }
            for (var r = 0u; r < TM; r++) {
                if (m0 + r < p.m) {
                    y[(m0 + r) * p.ldy + p.col0 + n] = acc[r][c] + b;
                }
            }
        }
    }
}
