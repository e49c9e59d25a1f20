//! [`CpuExecutor`]: the generic [`ModelRunner`] on [`CpuOps`].

use crate::cpu_ops::CpuOps;
use vellum_models::ModelRunner;

/// A model ready to run on the CPU: `CpuExecutor::load(CpuOps::default(),
/// weights, config, progress)`.
pub type CpuExecutor = ModelRunner<CpuOps>;
