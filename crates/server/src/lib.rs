//! # vellum-server — the `vellum` command line and the HTTP server
//!
//! Will hold `vellum serve`, the OpenAI-compatible HTTP server.
