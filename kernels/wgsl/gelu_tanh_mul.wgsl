// out = gelu_tanh(gate) · up, element-wise (GeGLU, Gemma):
// gelu_tanh(x) = 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).

struct Params {
    len: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<storage, read> gate: array<f32>;
@group(0) @binding(1) var<storage, read> up: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 64u;
    if (i >= p.len) {
        return;
    }
    let g = gate[i];
    // tanh through exp, clamped: WGSL's tanh is imprecise on some drivers
    // for large arguments.
    let t = clamp(0.7978845608 * (g + 0.044715 * g * g * g), -15.0, 15.0);
    let e = exp(2.0 * t);
    out[i] = 0.5 * g * (1.0 + (e - 1.0) / (e + 1.0)) * up[i];
}
