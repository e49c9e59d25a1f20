// Half-split ("rotate_half") RoPE in place on x [rows, heads · head_dim]:
// row r is at position positions[r]; the rotation of pair i of a head comes
// from the table (cos, sin) at [position, i], computed on the host in f64.

struct Params {
    rows: u32,
    cols: u32,
    head_dim: u32,
    positions: u32, // offset of the positions in `step`
}

@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read> step: array<u32>;
@group(0) @binding(2) var<storage, read> table: array<vec2<f32>>;
@group(0) @binding(3) var<uniform> p: Params;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = gid.x + gid.y * nwg.x * 64u;
    let half = p.head_dim / 2u;
    let per_row = p.cols / 2u;
    if (idx >= p.rows * per_row) {
        return;
    }
    let r = idx / per_row;
    let j = idx % per_row;
    let head = j / half;
    let i = j % half;
    let cs = table[step[p.positions + r] * half + i];
    let a = r * p.cols + head * p.head_dim + i;
    let b = a + half;
    let x0 = x[a];
    let x1 = x[b];
    x[a] = x0 * cs.x - x1 * cs.y;
    x[b] = x1 * cs.x + x0 * cs.y;
}
