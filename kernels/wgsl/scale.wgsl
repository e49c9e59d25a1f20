// x *= factor, element-wise (Gemma's embedding scale).

struct Params {
    len: u32,
    factor: u32, // f32 bits
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<uniform> p: Params;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 64u;
    if (i >= p.len) {
        return;
    }
    x[i] = x[i] * bitcast<f32>(p.factor);
}
