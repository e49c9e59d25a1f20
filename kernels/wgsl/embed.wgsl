// out[t, :] = row `token_ids[t]` of the embedding table, for the rows of one
// chunk of the table (row0 .. row0 + wn); tokens of other chunks are left to
// their chunk's dispatch. The weight format's `w_elem` is included before.

struct Params {
    rows: u32,     // tokens
    cols: u32,     // hidden size (= wk)
    ids: u32,      // offset of the token ids in `step`
    row0: u32,     // first table row of this chunk
    wn: u32,       // table rows in this chunk
    wk: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<storage, read> step: array<u32>;
@group(0) @binding(1) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 64u;
    if (i >= p.rows * p.cols) {
        return;
    }
    let t = i / p.cols;
    let id = step[p.ids + t];
    if (id < p.row0 || id >= p.row0 + p.wn) {
        return;
    }
    out[i] = w_elem(id - p.row0, i % p.cols);
}
