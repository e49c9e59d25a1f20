//! The device: adapter choice, limits, error capture, memory.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use vellum_base::Error;

/// What to install when no adapter is found.
const INSTALL_HINT: &str = "no Vulkan, Metal or DirectX 12 adapter was found; on Debian/Ubuntu install a Vulkan \
     driver (`apt-get install mesa-vulkan-drivers libvulkan1`; its lavapipe runs on the CPU), or pick one with \
     VELLUM_WGPU_ADAPTER=<name substring> / WGPU_BACKEND=vulkan|metal|dx12";

/// A wgpu device and queue with the adapter's own limits, and the first
/// error wgpu reported (wgpu reports errors through a callback; this
/// context turns them into typed errors at the next check instead of
/// letting wgpu panic).
pub struct GpuContext {
    /// The logical device.
    pub device: wgpu::Device,
    /// Its queue.
    pub queue: wgpu::Queue,
    /// Name, backend, driver.
    pub info: wgpu::AdapterInfo,
    /// The adapter's limits, all requested (wgpu's defaults would cap a
    /// storage binding at 128 MiB everywhere).
    pub limits: wgpu::Limits,
    /// Whether timestamp queries can time each kernel.
    pub timestamps: bool,
    error: Arc<Mutex<Option<String>>>,
    /// Bytes of device-local memory, where the driver says.
    device_local_bytes: Option<u64>,
    /// Bytes this context has allocated and not freed (weights, pools).
    allocated: AtomicU64,
}

impl std::fmt::Debug for GpuContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuContext").field("adapter", &self.info.name).field("backend", &self.info.backend).finish()
    }
}

impl GpuContext {
    /// Opens the best adapter: the one named by `VELLUM_WGPU_ADAPTER` (a
    /// substring of its name) if set, else a discrete GPU, an integrated
    /// one, a virtual one, then a CPU implementation (lavapipe).
    pub fn new() -> Result<Arc<Self>, Error> {
        let backends = wgpu::Backends::from_env().unwrap_or(wgpu::Backends::PRIMARY);
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor { backends, ..wgpu::InstanceDescriptor::new_without_display_handle() });
        let adapters = pollster::block_on(instance.enumerate_adapters(backends));
        let wanted = std::env::var("VELLUM_WGPU_ADAPTER").ok().map(|s| s.to_lowercase());
        let rank = |t: wgpu::DeviceType| match t {
            wgpu::DeviceType::DiscreteGpu => 0,
            wgpu::DeviceType::IntegratedGpu => 1,
            wgpu::DeviceType::VirtualGpu => 2,
            wgpu::DeviceType::Other => 3,
            wgpu::DeviceType::Cpu => 4,
        };
        let adapter = adapters
            .into_iter()
            .filter(|a| wanted.as_ref().is_none_or(|w| a.get_info().name.to_lowercase().contains(w)))
            .filter(|a| a.get_downlevel_capabilities().flags.contains(wgpu::DownlevelFlags::COMPUTE_SHADERS))
            .min_by_key(|a| rank(a.get_info().device_type))
            .ok_or_else(|| Error::Unavailable { what: "a wgpu adapter".into(), hint: INSTALL_HINT.into() })?;
        let info = adapter.get_info();
        let limits = adapter.limits();
        let timestamps = adapter.features().contains(wgpu::Features::TIMESTAMP_QUERY);
        let required_features = if timestamps { wgpu::Features::TIMESTAMP_QUERY } else { wgpu::Features::empty() };
        let device_local_bytes = device_local_bytes(&adapter);
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("vellum"),
            required_features,
            required_limits: limits.clone(),
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|e| Error::Backend(format!("wgpu: cannot open {}: {e}", info.name)))?;
        let error = Arc::new(Mutex::new(None));
        let sink = error.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            let mut slot = sink.lock().unwrap_or_else(|p| p.into_inner());
            if slot.is_none() {
                *slot = Some(e.to_string());
            }
        }));
        tracing::info!(
            adapter = %info.name,
            backend = ?info.backend,
            device_type = ?info.device_type,
            driver = %format!("{} {}", info.driver, info.driver_info).trim(),
            max_binding_mib = limits.max_storage_buffer_binding_size >> 20,
            timestamps,
            "wgpu adapter"
        );
        Ok(Arc::new(Self { device, queue, info, limits, timestamps, error, device_local_bytes, allocated: AtomicU64::new(0) }))
    }

    /// The first error wgpu reported since the last check, as a typed error.
    pub fn check(&self) -> Result<(), Error> {
        let taken = self.error.lock().unwrap_or_else(|p| p.into_inner()).take();
        match taken {
            None => Ok(()),
            Some(msg) if msg.to_lowercase().contains("out of memory") => {
                Err(Error::OutOfMemory { what: format!("wgpu ({}): {msg}", self.info.name), bytes: 0 })
            }
            Some(msg) => Err(Error::Backend(format!("wgpu ({}): {msg}", self.info.name))),
        }
    }

    /// Records `bytes` allocated (negative: freed) for memory accounting.
    pub fn account(&self, bytes: i64) {
        if bytes >= 0 {
            self.allocated.fetch_add(bytes as u64, Ordering::Relaxed);
        } else {
            self.allocated.fetch_sub(bytes.unsigned_abs(), Ordering::Relaxed);
        }
    }

    /// Bytes free for the KV cache: device-local memory less what this
    /// context holds; for a CPU adapter (lavapipe) or a driver that does not
    /// say, the host's available memory.
    pub fn available_bytes(&self) -> u64 {
        match (self.info.device_type, self.device_local_bytes) {
            (wgpu::DeviceType::Cpu, _) | (_, None) => host_available_bytes(),
            (_, Some(total)) => total.saturating_sub(self.allocated.load(Ordering::Relaxed)),
        }
    }

    /// "name (backend)", for logs.
    pub fn describe(&self) -> String {
        format!("wgpu: {} ({:?}, {:?})", self.info.name, self.info.backend, self.info.device_type)
    }

    /// A buffer of `size` bytes, or a typed error past the device's limit or
    /// when the allocation fails.
    pub fn buffer(&self, label: &str, size: u64, usage: wgpu::BufferUsages) -> Result<wgpu::Buffer, Error> {
        if size > self.limits.max_buffer_size {
            return Err(Error::OutOfMemory {
                what: format!("{label}: {size} bytes exceed {}'s largest buffer ({} bytes)", self.info.name, self.limits.max_buffer_size),
                bytes: size,
            });
        }
        let buf =
            self.device.create_buffer(&wgpu::BufferDescriptor { label: Some(label), size: size.max(4), usage, mapped_at_creation: false });
        self.check().map_err(|e| match e {
            Error::OutOfMemory { what, .. } => Error::OutOfMemory { what: format!("{label}: {what}"), bytes: size },
            e => e,
        })?;
        Ok(buf)
    }
}

/// Host memory the OS reports available (`MemAvailable`), or 4 GiB.
fn host_available_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            let line = m.lines().find(|l| l.starts_with("MemAvailable:"))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib * 1024)
        })
        .unwrap_or(4 << 30)
}

/// The largest device-local memory heap, asked of the Vulkan driver.
#[cfg(any(target_os = "linux", target_os = "windows", target_os = "android"))]
fn device_local_bytes(adapter: &wgpu::Adapter) -> Option<u64> {
    const DEVICE_LOCAL: u32 = 0x1; // VK_MEMORY_HEAP_DEVICE_LOCAL_BIT
                                   // SAFETY: the hal adapter is only read (two Vulkan property queries on
                                   // the physical device it wraps) while `adapter` keeps it alive, and no
                                   // handle escapes this block.
    unsafe {
        let hal = adapter.as_hal::<wgpu::hal::api::Vulkan>()?;
        let instance = hal.shared_instance().raw_instance();
        let props = instance.get_physical_device_memory_properties(hal.raw_physical_device());
        let n = (props.memory_heap_count as usize).min(props.memory_heaps.len());
        props.memory_heaps[..n].iter().filter(|h| h.flags.as_raw() & DEVICE_LOCAL != 0).map(|h| h.size).max()
    }
}

#[cfg(not(any(target_os = "linux", target_os = "windows", target_os = "android")))]
fn device_local_bytes(_adapter: &wgpu::Adapter) -> Option<u64> {
    None
}
