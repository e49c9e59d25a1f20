// RMSNorm of every `group`-wide slice of x (a whole row, or one head of a
// row for per-head q/k norms): out = x / sqrt(mean(x²) + eps) · w.
// One workgroup per slice; the sum of squares is reduced in workgroup memory.

struct Params {
    groups: u32,
    group: u32,
    eps: f32,
    _pad: u32,
}

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;

var<workgroup> red: array<f32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let g = wg.x + wg.y * nwg.x;
    if (g >= p.groups) {
        return;
    }
    let base = g * p.group;
    var s = 0.0;
    for (var i = lid; i < p.group; i += 64u) {
        let v = x[base + i];
        s += v * v;
    }
    red[lid] = s;
    workgroupBarrier();
    for (var off = 32u; off > 0u; off >>= 1u) {
        if (lid < off) {
            red[lid] += red[lid + off];
        }
        workgroupBarrier();
    }
    let inv = 1.0 / sqrt(red[0] / f32(p.group) + p.eps);
    for (var i = lid; i < p.group; i += 64u) {
        out[base + i] = x[base + i] * inv * w[i];
    }
}
