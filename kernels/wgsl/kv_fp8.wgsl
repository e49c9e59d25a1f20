// KV pool words for an FP8 E4M3 cache (vellum_base::fp8): four codes per
// word, the lowest index in the low byte. A code is the value divided by its
// layer's scale (write_kv multiplies by the inverse first), rounded to
// nearest, ties to even, saturating at ±448, as the CPU backend rounds.
// Read back as its value itself (the host folds only the layer's scales).
alias KvWord = u32;
const KV_PER_WORD: u32 = 4u;

fn fp8_code(x: f32) -> u32 {
    let u = bitcast<u32>(x);
    let sign = (u >> 24u) & 0x80u;
    let a = u & 0x7fffffffu;
    if (a > 0x7f800000u) {
        return sign | 0x7fu; // NaN
    }
    if (a >= 0x43e00000u) {
        return sign | 0x7eu; // 448 and beyond
    }
    if (a < 0x3c800000u) {
        // Below 2^-6: a multiple of 2^-9; round() ties to even.
        return sign | u32(round(bitcast<f32>(a) * 512.0));
    }
    let e = (a >> 23u) - 120u;
    let m = a & 0x7fffffu;
    let q = m >> 20u;
    let rest = m & 0xfffffu;
    var up = 0u;
    if (rest > 0x80000u || (rest == 0x80000u && (q & 1u) == 1u)) {
        up = 1u;
    }
    return sign | min((e << 3u) + q + up, 0x7eu);
}

// A code's value: the normals built as f32 bits, the subnormals as m · 2^-9
// (both exact, so no device's treatment of subnormal halves matters); the
// NaN codes give an f32 NaN.
fn fp8_value(c: u32) -> f32 {
    let e = (c >> 3u) & 0xfu;
    let m = c & 7u;
    var v = f32(m) * (1.0 / 512.0);
    if (e > 0u) {
        v = bitcast<f32>(((e + 120u) << 23u) | (m << 20u));
    }
    if ((c & 0x7fu) == 0x7fu) {
        // m is 7 here: all ones in the exponent, a mantissa, a NaN (built
        // from the code, not a constant NaN, which WGSL forbids).
        v = bitcast<f32>(0x7f800000u | (m << 20u));
    }
    return select(v, -v, (c & 0x80u) != 0u);
}

fn kv_unpack(w: u32, i: u32) -> f32 {
    return fp8_value((w >> (8u * i)) & 0xffu);
}

// The word of four consecutive elements.
fn kv_pack(x: vec4<f32>) -> u32 {
    return fp8_code(x.x) | (fp8_code(x.y) << 8u) | (fp8_code(x.z) << 16u) | (fp8_code(x.w) << 24u);
}

alias KvWord4 = u32;

fn kv_unpack4(w: u32) -> vec4<f32> {
    return vec4<f32>(fp8_value(w & 0xffu), fp8_value((w >> 8u) & 0xffu), fp8_value((w >> 16u) & 0xffu), fp8_value(w >> 24u));
}
