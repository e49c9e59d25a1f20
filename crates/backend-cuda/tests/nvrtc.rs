//! Every kernel of `kernels/cuda/`, in every configuration CI records,
//! compiles with NVRTC for compute_80 and compute_90 and defines exactly the
//! entry points the backend will look up by name.
//!
//! Without NVRTC the test says so by name and passes only when
//! `VELLUM_REQUIRE_NVRTC` is unset; CI sets it, so there it cannot skip.

use vellum_backend_cuda::kernels::{ci_variants, SOURCES};
use vellum_backend_cuda::nvrtc;

fn nvrtc_or_skip(test: &str) -> bool {
    if nvrtc::is_available() {
        return true;
    }
    assert!(std::env::var_os("VELLUM_REQUIRE_NVRTC").is_none(), "VELLUM_REQUIRE_NVRTC is set but NVRTC is not loadable");
    eprintln!("SKIPPED {test}: NVRTC is not loadable (pip install nvidia-cuda-nvrtc-cu12; LD_LIBRARY_PATH=<wheel>/lib)");
    false
}

#[test]
fn every_kernel_compiles_for_sm80_and_sm90_with_its_entry_points_or_skips_without_nvrtc() {
    if !nvrtc_or_skip("every_kernel_compiles_for_sm80_and_sm90_with_its_entry_points") {
        return;
    }
    eprintln!("NVRTC {:?}", nvrtc::version().expect("version"));
    let variants = ci_variants();
    for source in SOURCES {
        assert!(variants.iter().any(|v| v.source == source), "{} is compiled by no CI variant", source.file);
    }
    for arch in nvrtc::CI_ARCHS {
        for v in &variants {
            let ptx = nvrtc::compile(v, arch).unwrap_or_else(|e| panic!("{e}"));
            let mut found = nvrtc::entry_points(&ptx);
            found.sort();
            let mut expected: Vec<String> = v.source.entry_points.iter().map(|s| s.to_string()).collect();
            expected.sort();
            assert_eq!(found, expected, "{} for {arch}", v.label());
        }
    }
}

#[test]
fn a_kernel_that_does_not_compile_is_a_typed_error_with_the_log_or_skips_without_nvrtc() {
    if !nvrtc_or_skip("a_kernel_that_does_not_compile_is_a_typed_error_with_the_log") {
        return;
    }
    // HEAD_DIM 96 breaks the kernel's static_assert: the error names it.
    let bad =
        vellum_backend_cuda::kernels::Variant::new(vellum_backend_cuda::kernels::PAGED_ATTENTION, &[("HEAD_DIM", 96), ("BLOCK_SIZE", 16)]);
    let err = nvrtc::compile(&bad, "compute_80").expect_err("must not compile");
    let msg = err.to_string();
    assert!(msg.contains("HEAD_DIM must be a multiple of 64") && msg.contains("paged_attention.cu"), "{msg}");
}

#[test]
fn a_compiled_kernel_is_read_back_from_the_disk_cache_and_a_damaged_entry_recompiled_or_skips_without_nvrtc() {
    if !nvrtc_or_skip("a_compiled_kernel_is_read_back_from_the_disk_cache_and_a_damaged_entry_recompiled") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("vellum-kernel-cache-{}", std::process::id()));
    let v = vellum_backend_cuda::kernels::Variant::new(vellum_backend_cuda::kernels::CACHE, &[]);
    let fresh = nvrtc::compile(&v, "compute_80").expect("compiles");
    let first = nvrtc::compile_cached_in(&dir, &v, "compute_80").expect("compiles and stores");
    assert_eq!(first, fresh);
    let entries: Vec<_> = std::fs::read_dir(&dir).expect("the cache exists").filter_map(|e| e.ok()).collect();
    assert_eq!(entries.len(), 1, "one entry per configuration");
    let entry = entries[0].path();
    // Read back: change the stored PTX after its header, and the cache returns it.
    let text = std::fs::read_to_string(&entry).expect("reads");
    std::fs::write(&entry, format!("{text}// marker\n")).expect("writes");
    assert!(nvrtc::compile_cached_in(&dir, &v, "compute_80").expect("from the cache").ends_with("// marker\n"));
    // Another architecture or define is another entry.
    nvrtc::compile_cached_in(&dir, &v, "compute_90").expect("compiles");
    assert_eq!(std::fs::read_dir(&dir).expect("dir").count(), 2);
    // A damaged header is a miss: compiled again and rewritten.
    std::fs::write(&entry, "garbage").expect("writes");
    assert_eq!(nvrtc::compile_cached_in(&dir, &v, "compute_80").expect("recompiles"), fresh);
    assert!(std::fs::read_to_string(&entry).expect("rewritten").ends_with(&fresh));
    let _ = std::fs::remove_dir_all(&dir);
}
