//! # vellum-server — the `vellum` command line and the HTTP server
//!
//! Everything lives in the `vellum` binary (`src/main.rs`): `vellum serve`,
//! the OpenAI-compatible HTTP server (`src/serve/`), and the other
//! subcommands (`src/cli/`). See docs/serving.md.

#![deny(missing_docs)]
#![forbid(unsafe_code)]
