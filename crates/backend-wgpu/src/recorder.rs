//! Command recording: ops append dispatches and copies; a flush encodes
//! them into one command buffer (consecutive dispatches share a compute
//! pass, wgpu inserting the barriers between them) and submits it. Work is
//! flushed when the host needs a result (logits, swapped-out blocks) or
//! before it writes a buffer that pending work may still read.
//!
//! Each dispatch's parameters (a small uniform struct) go into one arena
//! per flush, at offsets aligned to `min_uniform_buffer_offset_alignment`.
//! With profiling on, every dispatch gets its own pass with timestamp
//! queries, summed per kernel.

use crate::context::GpuContext;
use crate::kernels::Kernel;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use vellum_base::Error;
use wgpu::util::DeviceExt;

/// A buffer range bound to a kernel: `(buffer, offset, size)`.
#[derive(Clone, Debug)]
pub struct Bound {
    /// The buffer.
    pub buf: wgpu::Buffer,
    /// Byte offset (a multiple of the storage offset alignment).
    pub offset: u64,
    /// Bytes bound.
    pub size: u64,
}

impl Bound {
    /// The whole of `buf`.
    pub fn whole(buf: &wgpu::Buffer) -> Self {
        Self { buf: buf.clone(), offset: 0, size: buf.size() }
    }
}

enum Cmd {
    Dispatch { kernel: Kernel, pipeline: Arc<Pipeline>, bound: Vec<Bound>, params: (u64, u64), groups: [u32; 3] },
    Copy { src: wgpu::Buffer, src_offset: u64, dst: wgpu::Buffer, dst_offset: u64, size: u64 },
}

struct Pipeline {
    pipeline: wgpu::ComputePipeline,
    layout: wgpu::BindGroupLayout,
}

#[derive(Default)]
struct Pending {
    cmds: Vec<Cmd>,
    params: Vec<u8>,
}

/// Time per kernel, from timestamp queries.
#[derive(Clone, Debug, Default)]
pub struct KernelProfile {
    /// `(kernel, dispatches, seconds)`, most time first.
    pub kernels: Vec<(&'static str, u64, f64)>,
}

impl KernelProfile {
    /// Seconds over all kernels.
    pub fn total_s(&self) -> f64 {
        self.kernels.iter().map(|k| k.2).sum()
    }
}

/// Records and submits the device work of one [`crate::WgpuOps`].
pub struct Recorder {
    ctx: Arc<GpuContext>,
    pending: Mutex<Pending>,
    pipelines: Mutex<HashMap<Kernel, Arc<Pipeline>>>,
    /// Per kernel: dispatches and nanoseconds, when profiling.
    profile: Mutex<Option<HashMap<&'static str, (u64, f64)>>>,
    staging: Mutex<Option<wgpu::Buffer>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Recorder {
    /// A recorder on `ctx`.
    pub fn new(ctx: Arc<GpuContext>) -> Self {
        Self {
            ctx,
            pending: Mutex::new(Pending::default()),
            pipelines: Mutex::new(HashMap::new()),
            profile: Mutex::new(None),
            staging: Mutex::new(None),
        }
    }

    /// Turns per-kernel timing on (where the adapter has timestamp queries)
    /// or off; returns whether it is on.
    pub fn set_profiling(&self, on: bool) -> bool {
        let on = on && self.ctx.timestamps;
        *lock(&self.profile) = on.then(HashMap::new);
        on
    }

    /// The time per kernel since profiling was turned on.
    pub fn profile(&self) -> KernelProfile {
        let mut kernels: Vec<_> =
            lock(&self.profile).as_ref().map(|p| p.iter().map(|(k, (n, ns))| (*k, *n, ns * 1e-9)).collect()).unwrap_or_default();
        kernels.sort_by(|a, b| b.2.total_cmp(&a.2));
        KernelProfile { kernels }
    }

    fn pipeline(&self, kernel: Kernel) -> Result<Arc<Pipeline>, Error> {
        if let Some(p) = lock(&self.pipelines).get(&kernel) {
            return Ok(p.clone());
        }
        let device = &self.ctx.device;
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(kernel.name()),
            source: wgpu::ShaderSource::Wgsl(kernel.source().into()),
        });
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(kernel.name()),
            layout: None,
            module: &module,
            entry_point: Some("main"),
            compilation_options: wgpu::PipelineCompilationOptions::default(),
            cache: None,
        });
        self.ctx.check().map_err(|e| Error::Backend(format!("compiling kernel {kernel:?}: {e}")))?;
        let layout = pipeline.get_bind_group_layout(0);
        let p = Arc::new(Pipeline { pipeline, layout });
        lock(&self.pipelines).insert(kernel, p.clone());
        Ok(p)
    }

    /// Appends a dispatch of `kernel` over `groups` workgroups with its
    /// storage bindings `bound` (bindings 0..) and its uniform parameters
    /// `params` (the last binding).
    pub fn dispatch(&self, kernel: Kernel, bound: Vec<Bound>, params: &[u8], groups: [u32; 3]) -> Result<(), Error> {
        if groups.contains(&0) {
            return Ok(());
        }
        let max = self.ctx.limits.max_compute_workgroups_per_dimension;
        if groups.iter().any(|&g| g > max) {
            return Err(Error::Backend(format!("{}: {groups:?} workgroups exceed the device's {max} per dimension", kernel.name())));
        }
        let pipeline = self.pipeline(kernel)?;
        let align = u64::from(self.ctx.limits.min_uniform_buffer_offset_alignment).max(16);
        let mut pending = lock(&self.pending);
        let offset = (pending.params.len() as u64).next_multiple_of(align);
        let size = (params.len() as u64).next_multiple_of(16);
        pending.params.resize((offset + size) as usize, 0);
        pending.params[offset as usize..offset as usize + params.len()].copy_from_slice(params);
        pending.cmds.push(Cmd::Dispatch { kernel, pipeline, bound, params: (offset, size), groups });
        Ok(())
    }

    /// `n` workgroups laid out within the per-dimension limit as `[x, y, 1]`;
    /// kernels recover the index as `wg.x + wg.y * num_workgroups.x`.
    pub fn groups_1d(&self, n: u64) -> [u32; 3] {
        let max = u64::from(self.ctx.limits.max_compute_workgroups_per_dimension).max(1);
        let x = n.min(max);
        [x as u32, n.div_ceil(x.max(1)) as u32, 1]
    }

    /// Appends a buffer-to-buffer copy.
    pub fn copy(&self, src: &wgpu::Buffer, src_offset: u64, dst: &wgpu::Buffer, dst_offset: u64, size: u64) {
        if size > 0 {
            lock(&self.pending).cmds.push(Cmd::Copy { src: src.clone(), src_offset, dst: dst.clone(), dst_offset, size });
        }
    }

    /// Writes `data` into `buf` at `offset` after everything recorded so far
    /// (which may still read the old contents) has been submitted.
    pub fn upload(&self, buf: &wgpu::Buffer, offset: u64, data: &[u8]) -> Result<(), Error> {
        self.flush()?;
        if !data.is_empty() {
            self.ctx.queue.write_buffer(buf, offset, data);
        }
        self.ctx.check()
    }

    /// Encodes and submits everything recorded.
    pub fn flush(&self) -> Result<(), Error> {
        let Pending { cmds, params } = std::mem::take(&mut *lock(&self.pending));
        if cmds.is_empty() {
            return self.ctx.check();
        }
        let device = &self.ctx.device;
        let arena = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("params"),
            contents: if params.is_empty() { &[0u8; 16] } else { &params },
            usage: wgpu::BufferUsages::UNIFORM,
        });
        let profiling = lock(&self.profile).is_some();
        let n_dispatch = cmds.iter().filter(|c| matches!(c, Cmd::Dispatch { .. })).count() as u32;
        let queries = if profiling && n_dispatch > 0 {
            Some(device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("kernel timestamps"),
                ty: wgpu::QueryType::Timestamp,
                count: 2 * n_dispatch,
            }))
        } else {
            None
        };
        let mut encoder = device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("vellum step") });
        let bind = |pipeline: &Pipeline, bound: &[Bound], params: (u64, u64)| {
            let mut entries: Vec<wgpu::BindGroupEntry<'_>> = bound
                .iter()
                .enumerate()
                .map(|(i, b)| wgpu::BindGroupEntry {
                    binding: i as u32,
                    resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                        buffer: &b.buf,
                        offset: b.offset,
                        size: wgpu::BufferSize::new(b.size.max(4)),
                    }),
                })
                .collect();
            entries.push(wgpu::BindGroupEntry {
                binding: bound.len() as u32,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: &arena,
                    offset: params.0,
                    size: wgpu::BufferSize::new(params.1),
                }),
            });
            device.create_bind_group(&wgpu::BindGroupDescriptor { label: None, layout: &pipeline.layout, entries: &entries })
        };
        let mut kernels = Vec::new();
        let mut i = 0;
        while i < cmds.len() {
            match &cmds[i] {
                Cmd::Copy { src, src_offset, dst, dst_offset, size } => {
                    encoder.copy_buffer_to_buffer(src, *src_offset, dst, *dst_offset, *size);
                    i += 1;
                }
                Cmd::Dispatch { .. } => {
                    // A run of dispatches: one pass, or one pass each when timed.
                    let end = cmds[i..].iter().position(|c| matches!(c, Cmd::Copy { .. })).map_or(cmds.len(), |p| i + p);
                    if let Some(qs) = &queries {
                        for cmd in &cmds[i..end] {
                            if let Cmd::Dispatch { kernel, pipeline, bound, params, groups } = cmd {
                                let q = 2 * kernels.len() as u32;
                                let group = bind(pipeline, bound, *params);
                                let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                                    label: Some(kernel.name()),
                                    timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                                        query_set: qs,
                                        beginning_of_pass_write_index: Some(q),
                                        end_of_pass_write_index: Some(q + 1),
                                    }),
                                });
                                pass.set_pipeline(&pipeline.pipeline);
                                pass.set_bind_group(0, &group, &[]);
                                pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
                                kernels.push(kernel.name());
                            }
                        }
                    } else {
                        let groups_of: Vec<wgpu::BindGroup> = cmds[i..end]
                            .iter()
                            .filter_map(|c| match c {
                                Cmd::Dispatch { pipeline, bound, params, .. } => Some(bind(pipeline, bound, *params)),
                                Cmd::Copy { .. } => None,
                            })
                            .collect();
                        let mut pass =
                            encoder.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("kernels"), timestamp_writes: None });
                        for (cmd, group) in cmds[i..end].iter().zip(&groups_of) {
                            if let Cmd::Dispatch { pipeline, groups, .. } = cmd {
                                pass.set_pipeline(&pipeline.pipeline);
                                pass.set_bind_group(0, group, &[]);
                                pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
                            }
                        }
                    }
                    i = end;
                }
            }
        }
        let timing = match &queries {
            Some(qs) => {
                let bytes = 16 * u64::from(n_dispatch);
                let resolve = self.ctx.buffer("timestamps", bytes, wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC)?;
                let read = self.ctx.buffer("timestamps readback", bytes, wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST)?;
                encoder.resolve_query_set(qs, 0..2 * n_dispatch, &resolve, 0);
                encoder.copy_buffer_to_buffer(&resolve, 0, &read, 0, bytes);
                Some(read)
            }
            None => None,
        };
        self.ctx.queue.submit([encoder.finish()]);
        self.ctx.check()?;
        if let Some(read) = timing {
            let bytes = self.map_read(&read, read.size())?;
            let period = f64::from(self.ctx.queue.get_timestamp_period());
            let mut guard = lock(&self.profile);
            if let Some(profile) = guard.as_mut() {
                for (k, pair) in kernels.iter().zip(bytes.chunks_exact(16)) {
                    let t0 = u64::from_le_bytes(pair[..8].try_into().unwrap_or_default());
                    let t1 = u64::from_le_bytes(pair[8..].try_into().unwrap_or_default());
                    let e = profile.entry(k).or_insert((0, 0.0));
                    e.0 += 1;
                    e.1 += t1.saturating_sub(t0) as f64 * period;
                }
            }
        }
        Ok(())
    }

    /// Waits for the device and returns the contents of a `MAP_READ` buffer.
    fn map_read(&self, buf: &wgpu::Buffer, size: u64) -> Result<Vec<u8>, Error> {
        let slice = buf.slice(..size);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.ctx
            .device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| Error::Backend(format!("wgpu ({}): waiting for the device: {e}", self.ctx.info.name)))?;
        match rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(Error::Backend(format!("wgpu: mapping a readback buffer: {e}"))),
            Err(_) => return Err(Error::Backend("wgpu: the readback was dropped".into())),
        }
        let data = slice.get_mapped_range().map_err(|e| Error::Backend(format!("wgpu: reading a mapped buffer: {e}")))?.to_vec();
        buf.unmap();
        self.ctx.check()?;
        Ok(data)
    }

    /// Runs everything recorded and copies `size` bytes of `buf` from
    /// `offset` to the host.
    pub fn read(&self, buf: &wgpu::Buffer, offset: u64, size: u64) -> Result<Vec<u8>, Error> {
        if size == 0 {
            self.flush()?;
            return Ok(Vec::new());
        }
        // The staging buffer stays locked until its bytes are copied out.
        let mut cached = lock(&self.staging);
        let staging = match cached.as_ref() {
            Some(b) if b.size() >= size => b.clone(),
            _ => {
                let b =
                    self.ctx.buffer("readback", size.next_power_of_two(), wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST)?;
                *cached = Some(b.clone());
                b
            }
        };
        self.copy(buf, offset, &staging, 0, size);
        self.flush()?;
        self.map_read(&staging, size)
    }
}
