//! # vellum-backend-wgpu — the WGSL backend
//!
//! Will hold the implementation of the core traits on `wgpu` compute shaders
//! (sources in `kernels/wgsl/`), for portability; it is tested headless on a
//! software Vulkan driver (lavapipe).
//!
//! Status: empty. Nothing here runs yet.
