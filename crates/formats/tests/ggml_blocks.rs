//! Dequantization against an independent implementation: random blocks of
//! every quantized type and the values the `gguf` Python package (0.19.0,
//! `gguf.quants.dequantize`, float32) computes for them, kept in
//! `tests/data/ggml_blocks.json`. The values must be equal bit for bit.

use vellum_formats::gguf::{dequantize, GgmlType};

fn ggml_type(name: &str) -> GgmlType {
    (0..64).filter_map(GgmlType::from_id).find(|t| t.to_string() == name).unwrap_or_else(|| panic!("unknown type {name}"))
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

#[test]
fn every_quantized_type_equals_gguf_py_bit_for_bit() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/ggml_blocks.json");
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let types = json["types"].as_object().unwrap();
    assert_eq!(types.len(), 10, "Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K");
    for (name, case) in types {
        let ty = ggml_type(name);
        let bytes = hex(case["hex"].as_str().unwrap());
        let want: Vec<f32> = case["values"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        let got = dequantize(ty, &bytes, want.len()).unwrap_or_else(|| panic!("{name}: not dequantizable"));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{name} value {i}: {g} vs gguf-py {w}");
        }
    }
}
