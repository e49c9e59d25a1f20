//! Kernel text built for the host with the machine's C++ compiler (the
//! `*_on_host` tests): finding the compiler, building a program.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The host's C++ compiler, if there is one (`$CXX`, `c++`, `g++` or
/// `clang++`).
#[allow(dead_code)] // Each test crate that includes this file uses what it needs.
pub fn compiler() -> Option<String> {
    let candidates = std::env::var("CXX").into_iter().chain(["c++", "g++", "clang++"].map(String::from));
    candidates.into_iter().find(|c| Command::new(c).arg("--version").output().is_ok_and(|o| o.status.success()))
}

/// The compiler, or `None` after saying `SKIPPED test` (a test without one
/// passes, by name).
#[allow(dead_code)] // Each test crate that includes this file uses what it needs.
pub fn compiler_or_skip(test: &str) -> Option<String> {
    let cxx = compiler();
    if cxx.is_none() {
        eprintln!("SKIPPED {test}: no C++ compiler (c++, g++, clang++ or $CXX)");
    }
    cxx
}

/// Writes `source` to `dir/name.cpp` and builds `dir/name` from it with
/// `cxx` (C++17, no contraction of multiplies and adds, so that the host
/// rounds as written); panics with the compiler's log on an error.
#[allow(dead_code)] // Each test crate that includes this file uses one of the two.
pub fn build(cxx: &str, dir: &Path, name: &str, source: &str) -> PathBuf {
    build_with(cxx, dir, name, source, &["-std=c++17"])
}

/// [`build`] for a kernel that uses barriers and shared memory, run with
/// one host thread per GPU thread (C++20's `std::barrier`, `-pthread`).
#[allow(dead_code)]
pub fn build_threaded(cxx: &str, dir: &Path, name: &str, source: &str) -> PathBuf {
    build_with(cxx, dir, name, source, &["-std=c++20", "-pthread"])
}

fn build_with(cxx: &str, dir: &Path, name: &str, source: &str, flags: &[&str]) -> PathBuf {
    let src = dir.join(format!("{name}.cpp"));
    std::fs::write(&src, source).expect("write the source");
    let exe = dir.join(name);
    let out = Command::new(cxx)
        .args(flags)
        .args(["-O1", "-ffp-contract=off", "-Wno-unknown-pragmas", "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
        .expect("run the compiler");
    assert!(out.status.success(), "{cxx} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    exe
}

/// Plain numbers as their bytes (native order), an input file of a host
/// program.
#[allow(dead_code)] // Each test crate that includes this file uses what it needs.
pub fn bytes_of<T: Copy>(v: &[T]) -> Vec<u8> {
    // SAFETY: `T` is a plain number type (f32, i32, u16, f64 in the
    // callers): every byte of the slice is initialized and readable.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)).to_vec() }
}

/// A host program's output file of plain f32s (native order, as
/// [`bytes_of`] writes its inputs).
#[allow(dead_code)] // Each test crate that includes this file uses what it needs.
pub fn read_f32s(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    bytes.chunks_exact(4).map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]])).collect()
}
