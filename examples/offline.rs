//! The offline API from a project that depends on the facade alone
//! (`vellum-llm`, library `vellum`), with the backend chosen by Cargo
//! feature: `cpu` by default, `--features wgpu` or `--features cuda` for a
//! GPU (thesis Listing 4.1).
//!
//!     cargo run --release --example offline                    # CPU
//!     cargo run --release --example offline --features wgpu    # Vulkan / Metal / DX12
//!     cargo run --release --example offline --features cuda    # NVIDIA
//!
//! The default model is fetched on first use. With several backends built
//! in, the most specific one wins (cuda, then wgpu, then cpu).

use vellum::core::SamplingParams;
use vellum::engine::{Device, EngineArgs, LLM};

/// The backend this build was compiled for.
fn device() -> Device {
    if cfg!(feature = "cuda") {
        Device::Cuda
    } else if cfg!(feature = "wgpu") {
        Device::Wgpu
    } else {
        Device::Cpu
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = EngineArgs { device: device(), ..EngineArgs::default() };
    let mut llm = LLM::new(args)?;
    let prompts = ["The capital of France is", "Paged attention stores the KV cache in"];
    for (prompt, out) in prompts.iter().zip(llm.generate(&prompts, &SamplingParams::greedy(16))?) {
        println!("{prompt:?} → {:?}", out.outputs[0].text);
    }
    Ok(())
}
