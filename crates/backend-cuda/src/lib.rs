//! # vellum-backend-cuda — the CUDA backend
//!
//! Will hold the implementation of the core traits on NVIDIA GPUs through
//! `cudarc`, loading the paged-attention kernels of `kernels/cuda/` (compiled
//! to PTX with NVRTC) lazily by name.
//!
//! Status: empty. Nothing here runs yet; the crate exists so that the
//! workspace has the shape of the design card and the `cuda` feature of the
//! `vellum` facade has somewhere to point.

#![deny(missing_docs)]
