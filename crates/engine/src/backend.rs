//! Backend selection: the one place that knows which backends this build
//! has (Cargo features `cpu`, `wgpu`, `cuda`) and turns a [`Device`] into a
//! [`ModelExecutor`].

use std::fmt;
use std::str::FromStr;
use vellum_base::{CudaGraphMode, Error, ModelConfig, ModelExecutor, WeightCopies};
use vellum_models::{RunnerOptions, WeightSource};

/// A model ready to run on the CPU:
/// `CpuExecutor::load(CpuOps::default(), weights, config, progress)`.
#[cfg(feature = "cpu")]
pub type CpuExecutor = vellum_models::ModelRunner<vellum_backend_cpu::CpuOps>;
/// A model ready to run on a wgpu device:
/// `WgpuExecutor::load(WgpuOps::new()?, weights, config, progress)`.
#[cfg(feature = "wgpu")]
pub type WgpuExecutor = vellum_models::ModelRunner<vellum_backend_wgpu::WgpuOps>;
/// A model ready to run on an NVIDIA GPU:
/// `CudaExecutor::load(CudaOps::new(0)?, weights, config, progress)`.
#[cfg(feature = "cuda")]
pub type CudaExecutor = vellum_models::ModelRunner<vellum_backend_cuda::CudaOps>;

/// Where a model runs (`--device`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Device {
    /// The CPU backend (`vellum-backend-cpu`): the reference, and the default.
    #[default]
    Cpu,
    /// The WGSL backend on wgpu (`vellum-backend-wgpu`): Vulkan, Metal or
    /// DirectX 12, headless.
    Wgpu,
    /// The CUDA backend (`vellum-backend-cuda`).
    Cuda,
}

impl Device {
    /// Every device, in `--device` order.
    pub const ALL: [Device; 3] = [Device::Cpu, Device::Wgpu, Device::Cuda];

    /// The name `--device` takes, which is also the Cargo feature.
    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Wgpu => "wgpu",
            Device::Cuda => "cuda",
        }
    }

    /// Whether this build has the backend (its Cargo feature was on).
    pub fn is_compiled(self) -> bool {
        match self {
            Device::Cpu => cfg!(feature = "cpu"),
            Device::Wgpu => cfg!(feature = "wgpu"),
            Device::Cuda => cfg!(feature = "cuda"),
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Device {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        Device::ALL
            .into_iter()
            .find(|d| d.name() == s.trim().to_ascii_lowercase())
            .ok_or_else(|| Error::InvalidConfig { field: "device", message: format!("unknown device {s:?}; one of cpu, wgpu, cuda") })
    }
}

/// How [`make_executor`] builds an executor: what every backend's runner
/// takes (the KV cache's element type, groups and block size, checked
/// against the backend's capabilities before a weight is read), and each
/// backend's own options, typed per backend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecutorOptions {
    /// The KV cache, for every backend.
    pub runner: RunnerOptions,
    /// The CPU backend's own (`--device cpu`; other backends ignore them).
    pub cpu: CpuOptions,
    /// What a GPU backend multiplies in (`--dtype`).
    pub dtype: ComputeDtype,
    /// Ranks the model is split over (`--tensor-parallel-size`; 1: whole).
    pub tensor_parallel_size: usize,
    /// Decode steps as CUDA graphs (`--device cuda`; others ignore it).
    pub cuda_graphs: CudaGraphs,
    /// Which quantized weights keep a bf16 copy for cuBLAS (`--device
    /// cuda`; others ignore it).
    pub cuda_weight_copies: WeightCopies,
}

/// How `--device cuda` records steps as CUDA graphs (thesis §4.6.3).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CudaGraphs {
    /// Which steps are recorded (`--compilation-config`'s `cudagraph_mode`;
    /// [`CudaGraphMode::None`] is vLLM's `--enforce-eager`).
    pub mode: CudaGraphMode,
    /// The token counts steps are padded to and recorded at (vLLM's
    /// `--cuda-graph-sizes`); `None`: 1, 2, 4, then every multiple of 8 up
    /// to 512.
    pub capture_sizes: Option<Vec<usize>>,
}

impl Default for ExecutorOptions {
    fn default() -> Self {
        Self {
            runner: RunnerOptions::default(),
            cpu: CpuOptions::default(),
            dtype: ComputeDtype::default(),
            tensor_parallel_size: 1,
            cuda_graphs: CudaGraphs::default(),
            cuda_weight_copies: WeightCopies::default(),
        }
    }
}

/// The element type a GPU backend's products take (vLLM's `--dtype`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ComputeDtype {
    /// The device's own: bfloat16 on `--device cuda` (tensor cores), float32
    /// on wgpu; the CPU's arithmetic is `--cpu-precision`.
    #[default]
    Auto,
    /// Activations rounded to bfloat16 before each product, f32
    /// accumulation (`--device cuda`).
    Bfloat16,
    /// float32 arithmetic throughout: the reference path (`--device cuda`,
    /// `--device wgpu`).
    Float32,
}

impl ComputeDtype {
    /// The name `--dtype` takes.
    pub fn name(self) -> &'static str {
        match self {
            ComputeDtype::Auto => "auto",
            ComputeDtype::Bfloat16 => "bfloat16",
            ComputeDtype::Float32 => "float32",
        }
    }

    /// Whether `device` multiplies in bfloat16 under this setting.
    pub fn is_bf16_on(self, device: Device) -> bool {
        device == Device::Cuda && self != ComputeDtype::Float32
    }

    /// `Ok` when `device` computes in this type, else the typed error that
    /// says what the device takes instead.
    pub fn check_for(self, device: Device) -> Result<(), Error> {
        let refuse = |what: &str| {
            Err(Error::InvalidConfig { field: "dtype", message: format!("--dtype {} on --device {device}: {what}", self.name()) })
        };
        match (device, self) {
            (_, ComputeDtype::Auto) | (Device::Cuda, _) | (Device::Wgpu, ComputeDtype::Float32) => Ok(()),
            (Device::Cpu, _) => refuse("the CPU's arithmetic is chosen with --cpu-precision int8|int16|float32"),
            (Device::Wgpu, _) => refuse("the wgpu backend computes in float32 (auto or float32)"),
        }
    }
}

impl FromStr for ComputeDtype {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(ComputeDtype::Auto),
            "bfloat16" | "bf16" => Ok(ComputeDtype::Bfloat16),
            "float32" | "float" | "f32" => Ok(ComputeDtype::Float32),
            "half" | "float16" | "f16" => Err(Error::InvalidConfig {
                field: "dtype",
                message: format!("--dtype {s}: float16 activations are not supported (their range ends at ±65504); use bfloat16"),
            }),
            _ => Err(Error::InvalidConfig { field: "dtype", message: format!("unknown dtype {s:?}; one of auto, bfloat16, float32") }),
        }
    }
}

/// The CPU backend's options.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CpuOptions {
    /// `--cpu-precision`.
    pub precision: CpuPrecision,
}

/// How the CPU backend multiplies the weights it keeps as integer blocks
/// (`--cpu-precision`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CpuPrecision {
    /// The file's blocks × activations quantized to int8 per block of 32,
    /// as llama.cpp does (the default: VNNI/`vpmaddubsw` kernels). Judged
    /// by the quantized-path rule: its logprob gaps to the float64
    /// references stay within llama.cpp's own on the same files (largest
    /// and mean, `tests/golden.rs`).
    #[default]
    Int8,
    /// The file's blocks × int16 activations: within 0.002 nats of the
    /// float64 references, at about half the int8 rate in batches.
    Int16,
    /// Every weight widened to float32 (the reference path).
    Float32,
}

impl CpuPrecision {
    /// The name `--cpu-precision` takes.
    pub fn name(self) -> &'static str {
        match self {
            CpuPrecision::Int8 => "int8",
            CpuPrecision::Int16 => "int16",
            CpuPrecision::Float32 => "float32",
        }
    }
}

impl FromStr for CpuPrecision {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s.trim().to_ascii_lowercase().as_str() {
            "int8" => Ok(CpuPrecision::Int8),
            "int16" => Ok(CpuPrecision::Int16),
            "float32" | "f32" => Ok(CpuPrecision::Float32),
            _ => Err(Error::InvalidConfig {
                field: "cpu-precision",
                message: format!("unknown CPU precision {s:?}; one of int8, int16, float32"),
            }),
        }
    }
}

impl Device {
    /// `Ok` when this build has the backend, else the typed error naming
    /// the Cargo feature to turn on.
    pub fn ensure_compiled(self) -> Result<(), Error> {
        if self.is_compiled() {
            Ok(())
        } else {
            Err(not_compiled(self))
        }
    }
}

/// The error for a backend this build left out.
fn not_compiled(device: Device) -> Error {
    Error::Unavailable {
        what: format!("--device {device}"),
        hint: format!(
            "this build has no `{device}` backend; rebuild with the Cargo feature `{device}` \
             (e.g. `cargo run --release -p vellum-server --features {device} -- ...`)"
        ),
    }
}

/// Loads `weights` onto `device`'s backend as a [`ModelExecutor`] with
/// `options` (its KV cache's element type, groups and block size; the
/// CPU's integer kernels' precision), after checking the backend supports
/// them and the model's head size; `progress(layers_done, layers)` is
/// called while the weights load. (`VELLUM_CPU_WEIGHTS=q4|q8` re-quantizes every
/// weight, for kernel benchmarks.)
pub fn make_executor(
    device: Device,
    weights: &dyn WeightSource,
    config: ModelConfig,
    options: ExecutorOptions,
    progress: impl FnMut(usize, usize),
) -> Result<Box<dyn ModelExecutor + Send>, crate::Error> {
    // Each arm is compiled only with its feature; the others are typed errors.
    let _ = (&weights, &config, &options);
    options.dtype.check_for(device)?;
    let tp = options.tensor_parallel_size;
    // The split is checked before a backend starts or a weight is read.
    vellum_models::TensorParallel::check(tp, &config)?;
    match device {
        #[cfg(feature = "cpu")]
        Device::Cpu => {
            use vellum_backend_cpu::{ActBits, CpuOps, WeightFormat};
            let ops = match options.cpu.precision {
                CpuPrecision::Float32 => CpuOps::new(WeightFormat::F32),
                CpuPrecision::Int16 => CpuOps::new(WeightFormat::from_env()).with_activations(ActBits::I16),
                CpuPrecision::Int8 => CpuOps::new(WeightFormat::from_env()).with_activations(ActBits::I8),
            };
            if tp > 1 {
                let group = ops.tensor_parallel_group(tp);
                return Ok(Box::new(CpuExecutor::load_tensor_parallel(group, weights, config, options.runner, progress)?));
            }
            Ok(Box::new(CpuExecutor::load_with(ops, weights, config, options.runner, progress)?))
        }
        #[cfg(feature = "wgpu")]
        Device::Wgpu if tp > 1 => Err(Error::InvalidConfig {
            field: "tensor-parallel-size",
            message: format!("--tensor-parallel-size {tp} on --device wgpu: tensor parallelism runs on --device cpu and --device cuda"),
        }
        .into()),
        #[cfg(feature = "wgpu")]
        Device::Wgpu => {
            let ops = vellum_backend_wgpu::WgpuOps::new()?;
            Ok(Box::new(WgpuExecutor::load_with(ops, weights, config, options.runner, progress)?))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda => {
            use vellum_backend_cuda::{CudaOps, CudaPrecision};
            let precision = if options.dtype.is_bf16_on(device) { CudaPrecision::Bf16 } else { CudaPrecision::Float32 };
            // VELLUM_TP_COLLECTIVE=1 runs one GPU as an NCCL group of one:
            // the tensor-parallel path end to end where only one GPU is.
            let collective = tp == 1 && std::env::var("VELLUM_TP_COLLECTIVE").is_ok_and(|v| v == "1");
            if tp > 1 || collective {
                // One rank per GPU (ordinals 0..tp), all-reduces over NCCL.
                let group = CudaOps::tensor_parallel_group(tp, precision).map_err(cuda_unavailable)?;
                let group = group.into_iter().map(|ops| ops.with_weight_copies(options.cuda_weight_copies)).collect();
                return Ok(Box::new(CudaExecutor::load_tensor_parallel(group, weights, config, options.runner, progress)?));
            }
            let capture_sizes = match options.cuda_graphs.capture_sizes {
                Some(sizes) => vellum_backend_cuda::CaptureSizes::new(sizes).ok_or_else(|| Error::InvalidConfig {
                    field: "cuda-graph-sizes",
                    message: "--cuda-graph-sizes takes batch sizes of at least 1".into(),
                })?,
                None => vellum_backend_cuda::CaptureSizes::default(),
            };
            let graphs = vellum_backend_cuda::GraphOptions { mode: options.cuda_graphs.mode, capture_sizes };
            let ops = CudaOps::with_precision(0, precision)
                .map_err(cuda_unavailable)?
                .with_graphs(graphs)
                .with_weight_copies(options.cuda_weight_copies);
            Ok(Box::new(CudaExecutor::load_with(ops, weights, config, options.runner, progress)?))
        }
        #[allow(unreachable_patterns)]
        other => {
            let _ = progress;
            Err(not_compiled(other).into())
        }
    }
}

/// Why `--device cuda` cannot run: no driver, no GPU or no NVRTC (typed
/// errors from the probe, which never panics).
#[cfg(feature = "cuda")]
fn cuda_unavailable(e: vellum_backend_cuda::CudaError) -> Error {
    Error::Unavailable { what: "--device cuda".into(), hint: e.to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtypes_parse_as_vllm_names_them_and_each_device_refuses_what_it_cannot_compute() {
        for (s, d) in [
            ("auto", ComputeDtype::Auto),
            ("bfloat16", ComputeDtype::Bfloat16),
            ("BF16", ComputeDtype::Bfloat16),
            ("float", ComputeDtype::Float32),
        ] {
            assert_eq!(s.parse::<ComputeDtype>().ok(), Some(d), "{s}");
        }
        let half = "float16".parse::<ComputeDtype>().expect_err("f16 activations are refused");
        assert!(half.to_string().contains("use bfloat16"), "{half}");
        assert!(matches!("int4".parse::<ComputeDtype>(), Err(Error::InvalidConfig { field: "dtype", .. })));
        assert!(ComputeDtype::Auto.is_bf16_on(Device::Cuda) && !ComputeDtype::Float32.is_bf16_on(Device::Cuda));
        assert!(!ComputeDtype::Bfloat16.is_bf16_on(Device::Wgpu));
        for d in [ComputeDtype::Auto, ComputeDtype::Bfloat16, ComputeDtype::Float32] {
            assert!(d.check_for(Device::Cuda).is_ok());
        }
        assert!(ComputeDtype::Float32.check_for(Device::Wgpu).is_ok());
        let e = ComputeDtype::Bfloat16.check_for(Device::Wgpu).expect_err("wgpu computes in f32");
        assert!(e.to_string().contains("--dtype bfloat16 on --device wgpu"), "{e}");
        let e = ComputeDtype::Float32.check_for(Device::Cpu).expect_err("the CPU has --cpu-precision");
        assert!(e.to_string().contains("--cpu-precision"), "{e}");
    }

    #[test]
    fn devices_parse_by_name() {
        for d in Device::ALL {
            assert_eq!(d.name().parse::<Device>().ok(), Some(d));
        }
        assert_eq!(" WGPU".parse::<Device>().ok(), Some(Device::Wgpu));
        assert!(matches!("tpu".parse::<Device>(), Err(Error::InvalidConfig { field: "device", .. })));
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn device_cuda_is_a_typed_error_with_or_without_a_driver_never_a_panic() {
        match vellum_backend_cuda::CudaOps::new(0) {
            Ok(ops) => eprintln!("a GPU is present: {ops:?}"),
            Err(e) => {
                let msg = cuda_unavailable(e).to_string();
                assert!(msg.contains("--device cuda"), "{msg}");
                if !vellum_backend_cuda::device::driver_is_present() {
                    assert!(msg.contains("no CUDA driver found"), "{msg}");
                }
            }
        }
    }

    #[test]
    fn a_missing_backend_is_a_typed_error_naming_its_feature() {
        for d in Device::ALL.into_iter().filter(|d| !d.is_compiled()) {
            let msg = not_compiled(d).to_string();
            assert!(msg.contains(&format!("--features {d}")), "{msg}");
        }
    }
}
