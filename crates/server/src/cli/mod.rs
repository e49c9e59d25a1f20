//! Subcommands of `vellum`, one module each.

pub mod paper_reproduction;
pub mod plot;
pub mod simulate;
