//! # vellum-simulator — the real scheduler and KV-cache manager in simulated time
//!
//! A fake executor charges each step a time from a [`CostModel`]; nothing
//! sleeps, so an hour-long trace runs in seconds. Traces ([`Workload`]) have
//! Poisson arrivals and long-tailed lengths shaped like the paper's ShareGPT
//! and Alpaca datasets (§6.1). [`simulate`] runs one trace against the paged
//! manager or an Orca baseline and returns a [`SimReport`] with the paper's
//! memory metrics.

#![deny(missing_docs)]
#![forbid(unsafe_code)]

mod calibration;
mod cost_model;
mod simulator;
mod workload;

pub use calibration::{calibrate, Calibration, PAPER_FIG13A_RATIO_VS_MAX, PAPER_FIG13A_RATIO_VS_ORACLE};
pub use cost_model::{CostModel, FITTED_TIME_SCALE};
pub use simulator::{simulate, AllocatorKind, SimConfig, SimReport};
pub use vellum_base::SeededRng as Rng;
pub use workload::{generate_trace, TraceRequest, Workload};
