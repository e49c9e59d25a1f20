//! Subcommands of `vellum`, one module each.

pub mod generate;
pub mod paper_reproduction;
pub mod plot;
pub mod simulate;
