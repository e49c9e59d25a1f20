//! Tensor parallelism over NCCL: one communicator per GPU of one process
//! (`ncclCommInitAll`), one rank per GPU, each rank's all-reduce enqueued on
//! its [`CudaOps`](crate::CudaOps)'s stream so that it is ordered with the
//! rank's kernels. NCCL is loaded at run time like the driver (cudarc opens
//! `libnccl.so`; link a `libnccl.so.2` under that name): a machine without
//! it gets [`CudaError::NoNccl`] when a group is asked for, and a single GPU
//! without a group never needs it. A failed step aborts the communicators
//! ([`NcclGroup::fail`]): the group cannot be restarted, and every later
//! step fails with [`vellum_ops::GROUP_FAILED`].

use crate::error::CudaError;
use cudarc::driver::{CudaSlice, CudaStream};
use cudarc::nccl::{Comm, ReduceOp};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// Whether NCCL's library loads.
pub fn nccl_is_present() -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on NCCL's library names
    // and drops what it opened; loading libnccl runs no initializer with
    // preconditions of ours.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

/// A communicator handle that may move between threads.
struct SendComm(Comm);

// SAFETY: an NCCL communicator is an opaque handle that any host thread may
// use, one call at a time (NCCL forbids concurrent calls on one
// communicator, not calls from different threads); `NcclGroup` keeps each
// behind a `Mutex`, so calls on it never overlap.
unsafe impl Send for SendComm {}

/// The communicators of one tensor-parallel group, rank `r` on the `r`-th
/// stream given to [`NcclGroup::new`].
pub struct NcclGroup {
    comms: Vec<Mutex<Option<SendComm>>>,
    failed: AtomicBool,
}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclGroup").field("size", &self.comms.len()).field("failed", &self.failed.load(Ordering::Relaxed)).finish()
    }
}

impl NcclGroup {
    /// A group over `streams`, one per GPU (rank `r` on `streams[r]`).
    pub fn new(streams: Vec<Arc<CudaStream>>) -> Result<Self, CudaError> {
        if !nccl_is_present() {
            return Err(CudaError::NoNccl);
        }
        let comms = Comm::from_devices(streams).map_err(|e| CudaError::Nccl(format!("{e:?}")))?;
        Ok(Self { comms: comms.into_iter().map(|c| Mutex::new(Some(SendComm(c)))).collect(), failed: AtomicBool::new(false) })
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.comms.len()
    }

    /// Sums the first `len` values of `buf` over the group, in place, as
    /// rank `rank`: enqueued on the rank's stream (every rank must enqueue
    /// its own, with the same `len`).
    pub fn all_reduce(&self, rank: usize, buf: &mut CudaSlice<f32>, len: usize) -> Result<(), CudaError> {
        if self.failed.load(Ordering::Acquire) {
            return Err(CudaError::Nccl(vellum_ops::GROUP_FAILED.into()));
        }
        let slot = self.comms.get(rank).ok_or_else(|| CudaError::Nccl(format!("rank {rank} of a group of {}", self.size())))?;
        let guard = slot.lock().map_err(|_| CudaError::Nccl("a rank panicked inside an all-reduce".into()))?;
        let comm = guard.as_ref().ok_or_else(|| CudaError::Nccl("the communicator was aborted".into()))?;
        if len > buf.len() {
            return Err(CudaError::Shape(format!("all-reduce of {len} values from a buffer of {}", buf.len())));
        }
        let mut view = buf.slice_mut(0..len);
        comm.0.all_reduce_in_place(&mut view, &ReduceOp::Sum).map_err(|e| CudaError::Nccl(format!("ncclAllReduce: {e:?}")))?;
        Ok(())
    }

    /// Fails the group: later all-reduces return an error, and, unless the
    /// calling thread is unwinding (where a second panic would abort the
    /// process), every communicator is aborted (`ncclCommAbort`), which
    /// releases the kernels of ranks waiting for this one.
    pub fn fail(&self) {
        self.failed.store(true, Ordering::Release);
        if std::thread::panicking() {
            return;
        }
        for slot in &self.comms {
            let comm = slot.lock().ok().and_then(|mut c| c.take());
            // Dropping a communicator aborts it; cudarc panics if the abort
            // itself fails, which must not take the engine down.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(comm)));
        }
    }
}
