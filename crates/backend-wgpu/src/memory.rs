//! Device buffers: long-lived ones (weights, KV pools) counted against the
//! device's memory, and a pool of activation buffers reused step after step.

use crate::context::GpuContext;
use crate::recorder::Bound;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use vellum_base::Error;

/// Usage of every buffer kernels read or write.
pub const STORAGE: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE.union(wgpu::BufferUsages::COPY_SRC).union(wgpu::BufferUsages::COPY_DST);

/// A long-lived buffer, counted in [`GpuContext::available_bytes`] while it
/// lives.
#[derive(Debug)]
pub struct DeviceBuffer {
    /// The buffer.
    pub buf: wgpu::Buffer,
    ctx: Arc<GpuContext>,
}

impl DeviceBuffer {
    /// A zeroed storage buffer of `size` bytes.
    pub fn new(ctx: &Arc<GpuContext>, label: &str, size: u64) -> Result<Self, Error> {
        let buf = ctx.buffer(label, size, STORAGE)?;
        ctx.account(buf.size() as i64);
        Ok(Self { buf, ctx: ctx.clone() })
    }

    /// A storage buffer holding `data`.
    pub fn with_data(ctx: &Arc<GpuContext>, label: &str, data: &[u8]) -> Result<Self, Error> {
        let b = Self::new(ctx, label, data.len() as u64)?;
        if !data.is_empty() {
            ctx.queue.write_buffer(&b.buf, 0, data);
            // Submitting nothing still lands the write and frees its staging.
            ctx.queue.submit(std::iter::empty());
            ctx.check()?;
        }
        Ok(b)
    }

    /// The whole buffer as a binding.
    pub fn bound(&self) -> Bound {
        Bound::whole(&self.buf)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        self.ctx.account(-(self.buf.size() as i64));
    }
}

/// Free activation buffers by size class (powers of two from 256 bytes).
pub struct BufferPool {
    ctx: Arc<GpuContext>,
    free: Mutex<HashMap<u64, Vec<wgpu::Buffer>>>,
}

impl BufferPool {
    /// An empty pool.
    pub fn new(ctx: Arc<GpuContext>) -> Arc<Self> {
        Arc::new(Self { ctx, free: Mutex::new(HashMap::new()) })
    }

    /// A buffer of at least `bytes` (contents undefined).
    pub fn take(self: &Arc<Self>, bytes: u64) -> Result<Pooled, Error> {
        let class = bytes.max(256).next_power_of_two();
        let reused = self.free.lock().unwrap_or_else(|p| p.into_inner()).get_mut(&class).and_then(Vec::pop);
        let buf = match reused {
            Some(b) => b,
            None => self.ctx.buffer("activations", class, STORAGE)?,
        };
        Ok(Pooled { buf, class, pool: self.clone() })
    }
}

/// A buffer on loan from a [`BufferPool`], returned when dropped. Work
/// already recorded may still use it: the queue runs in order, so a later
/// user of the same buffer only touches it after that work.
pub struct Pooled {
    /// The buffer.
    pub buf: wgpu::Buffer,
    class: u64,
    pool: Arc<BufferPool>,
}

impl std::fmt::Debug for Pooled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pooled").field("bytes", &self.class).finish()
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        self.pool.free.lock().unwrap_or_else(|p| p.into_inner()).entry(self.class).or_default().push(self.buf.clone());
    }
}
