//! Writes the PTX of every CI kernel configuration for one architecture,
//! for `kernels/cuda/ptxas_table.sh` (registers and spills per kernel):
//!
//!     cargo run -p vellum-backend-cuda --example dump_ptx -- OUT_DIR compute_90

use vellum_backend_cuda::{kernels::ci_variants, nvrtc};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(dir), Some(arch)) = (args.get(1), args.get(2)) else {
        return Err("usage: dump_ptx OUT_DIR compute_80|compute_90".into());
    };
    if !arch.starts_with("compute_") {
        return Err(format!("{arch} is not a virtual architecture (compute_80, compute_90, ...)").into());
    }
    std::fs::create_dir_all(dir)?;
    for v in ci_variants() {
        let ptx = nvrtc::compile(&v, arch)?;
        let name = v.label().replace(".cu", "").replace([' ', '='], "_");
        std::fs::write(format!("{dir}/{name}.ptx"), ptx)?;
        println!("{name}");
    }
    Ok(())
}
