// out[r, :] = x[rows[r], :]: the rows whose logits a step returns.

struct Params {
    rows: u32,
    cols: u32,
    index: u32, // offset of the row indices in `step`
    _pad: u32,
}

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> step: array<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 64u;
    if (i >= p.rows * p.cols) {
        return;
    }
    let r = i / p.cols;
    out[i] = x[step[p.index + r] * p.cols + i % p.cols];
}
