//! A team of helper threads that spin between the operations of a forward
//! pass, so a parallel linear layer starts on every core within a
//! microsecond instead of waiting for a sleeping thread to be woken.
//!
//! Why: a decode step of a small model runs ~250 parallel sections of
//! 10–100 µs each. Through rayon, the idle worker falls asleep between
//! sections and every section pays a futex wake-up and the context
//! switches around it: 20–25% of a single-stream decode step on the 2-vCPU
//! machine of this project (`perf`: `finish_task_switch`, `__schedule`,
//! `sched_yield`). llama.cpp's thread pool spins between operations for the
//! same reason. The helpers here spin for [`SPIN`] after their last job and
//! then park, so an idle engine costs nothing.
//!
//! Every parallel section of a forward pass runs here ([`run`], or
//! [`for_chunks_mut`] over a mutable slice), not only the linears: while
//! a helper spins, a rayon section (attention, a norm) woke a worker
//! beside it, three busy threads on two cores, and a 64-sequence decode
//! step lost 10% to that.
//!
//! One team per process, sized to the rayon pool (`RAYON_NUM_THREADS`),
//! used by one caller at a time: [`run`] falls back to a rayon scope when
//! the team is busy (another engine in the same process) or when called
//! from a helper.
//!
//! The protocol: the caller publishes a job (a borrowed `Fn(usize)` and a
//! chunk count) and bumps `epoch`; helpers and the caller claim chunk
//! indices with `fetch_add` until none are left. A helper announces itself
//! in `active` *before* it checks that the job is still `open`; the caller
//! closes the job *before* waiting for `active` to reach zero. Both sides
//! use sequentially consistent operations, so either the helper sees the job
//! closed and never touches it, or the caller sees the helper and waits for
//! it: the borrowed closure is never used after [`run`] returns.

use std::cell::{Cell, UnsafeCell};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// How long a helper spins for the next job before it parks.
const SPIN: Duration = Duration::from_micros(300);

/// The job's closure with its lifetime erased (see [`run`] for why it is
/// never used after the borrow ends).
type Job = *const (dyn Fn(usize) + Sync);

struct Shared {
    /// Incremented once per published job.
    epoch: AtomicUsize,
    /// Whether the current job may still be joined.
    open: AtomicBool,
    /// Next chunk to claim.
    next: AtomicUsize,
    /// Chunks finished.
    done: AtomicUsize,
    /// Helpers between announcing themselves and leaving the job.
    active: AtomicUsize,
    /// The job and its chunk count, written by the caller only while no
    /// helper can read them (before `epoch` is bumped, with `open` false
    /// and `active` zero).
    job: UnsafeCell<(Option<Job>, usize)>,
    /// Helpers parked (or about to park), to be unparked by the next job.
    parked: Vec<AtomicBool>,
    /// Set when the process no longer needs the team (never, in practice).
    stop: AtomicBool,
    /// Set when a chunk of the current job panicked.
    panicked: AtomicBool,
}

// SAFETY: `job` is written only by the one caller holding the team's lock,
// while the protocol above keeps every helper from reading it; the closure
// it points to is `Sync`, so helpers may call it concurrently.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw pointer is only dereferenced under the protocol.
unsafe impl Send for Shared {}

struct Team {
    shared: Arc<Shared>,
    threads: Vec<Thread>,
    /// One caller at a time.
    lock: Mutex<()>,
}

thread_local! {
    /// Set on the team's own threads (a job that calls [`run`] again must
    /// not wait for itself).
    static IS_HELPER: Cell<bool> = const { Cell::new(false) };
}

fn team() -> &'static Team {
    static TEAM: OnceLock<Team> = OnceLock::new();
    TEAM.get_or_init(|| {
        let helpers = rayon::current_num_threads().saturating_sub(1);
        let shared = Arc::new(Shared {
            epoch: AtomicUsize::new(0),
            open: AtomicBool::new(false),
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            job: UnsafeCell::new((None, 0)),
            parked: (0..helpers).map(|_| AtomicBool::new(false)).collect(),
            stop: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
        });
        let threads = (0..helpers)
            .filter_map(|i| {
                let s = Arc::clone(&shared);
                std::thread::Builder::new().name(format!("vellum-spin-{i}")).spawn(move || helper(&s, i)).ok().map(|h| h.thread().clone())
            })
            .collect();
        Team { shared, threads, lock: Mutex::new(()) }
    })
}

/// Claims and runs chunks of the current job until none are left.
fn work(s: &Shared, job: Job, n: usize) {
    loop {
        let i = s.next.fetch_add(1, SeqCst);
        if i >= n {
            return;
        }
        // A panic is caught and counted, so the job still completes and the
        // caller (which re-raises it) never unwinds while helpers hold `f`.
        // SAFETY: the job is open and this thread is counted in `active`
        // (or is the caller), so the closure outlives this call (module doc).
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe { (*job)(i) }));
        if ran.is_err() {
            s.panicked.store(true, SeqCst);
        }
        s.done.fetch_add(1, SeqCst);
    }
}

fn helper(s: &Shared, me: usize) {
    IS_HELPER.with(|h| h.set(true));
    let mut seen = s.epoch.load(SeqCst);
    while !s.stop.load(SeqCst) {
        // Wait for a new epoch: spin, then park.
        let start = Instant::now();
        let mut spins = 0u32;
        while s.epoch.load(SeqCst) == seen {
            std::hint::spin_loop();
            spins += 1;
            if spins.is_multiple_of(64) && start.elapsed() > SPIN {
                s.parked[me].store(true, SeqCst);
                if s.epoch.load(SeqCst) == seen {
                    std::thread::park();
                }
                s.parked[me].store(false, SeqCst);
                break;
            }
        }
        let now = s.epoch.load(SeqCst);
        if now == seen {
            continue;
        }
        seen = now;
        s.active.fetch_add(1, SeqCst);
        if s.open.load(SeqCst) && s.epoch.load(SeqCst) == seen {
            // SAFETY: the job is open and this helper is counted in `active`,
            // so the caller does not rewrite `job` until it leaves.
            let (job, n) = unsafe { *s.job.get() };
            if let Some(job) = job {
                work(s, job, n);
            }
        }
        s.active.fetch_sub(1, SeqCst);
    }
}

/// Runs `f(0)`, …, `f(n - 1)` across the calling thread and the team's
/// helpers, returning when all have finished. Falls back to a rayon scope
/// when the team is busy, has no helpers, or this is a helper thread.
pub fn run(n: usize, f: &(dyn Fn(usize) + Sync)) {
    if n == 0 {
        return;
    }
    let team = team();
    let fallback = || {
        rayon::scope(|sc| {
            for i in 0..n {
                sc.spawn(move |_| f(i));
            }
        })
    };
    if n == 1 {
        return f(0);
    }
    if team.threads.is_empty() || IS_HELPER.with(Cell::get) {
        return fallback();
    }
    let Ok(_guard) = team.lock.try_lock() else {
        return fallback();
    };
    let s = &*team.shared;
    // SAFETY: the erased lifetime: the pointer is used only while the job
    // is open or by threads counted in `active`, and this function closes
    // the job and waits for `active` to drain before it returns.
    let job: Job = unsafe { std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), Job>(f as *const _) };
    // SAFETY: the previous job is closed and `active` was drained before the
    // previous call returned; a helper that announced itself since sees
    // `open` false and leaves without reading `job`.
    unsafe { *s.job.get() = (Some(job), n) };
    s.next.store(0, SeqCst);
    s.done.store(0, SeqCst);
    s.panicked.store(false, SeqCst);
    s.open.store(true, SeqCst);
    s.epoch.fetch_add(1, SeqCst);
    for (t, parked) in team.threads.iter().zip(&s.parked) {
        if parked.load(SeqCst) {
            t.unpark();
        }
    }
    work(s, job, n);
    while s.done.load(SeqCst) < n {
        std::hint::spin_loop();
    }
    s.open.store(false, SeqCst);
    while s.active.load(SeqCst) > 0 {
        std::hint::spin_loop();
    }
    assert!(!s.panicked.load(SeqCst), "a chunk of a parallel section panicked");
}

/// A pointer to the elements of a slice borrowed mutably by
/// [`for_chunks_mut`], shared with the threads that run its chunks.
struct ChunkBase<T>(*mut T);

// SAFETY: the threads only form disjoint chunks from it (each index is run
// once) while the `&mut` borrow it came from is held; sending those chunks
// needs `T: Send`.
unsafe impl<T: Send> Sync for ChunkBase<T> {}

/// Runs `f(i, chunk)` for each chunk `i` of `data` (`len` elements, the last
/// one shorter), across the calling thread and the team's helpers as
/// [`run`] does: the same threads as the linear layers, so that no rayon
/// worker wakes beside a spinning helper (two threads on one core).
pub fn for_chunks_mut<T: Send>(data: &mut [T], len: usize, f: &(dyn Fn(usize, &mut [T]) + Sync)) {
    let len = len.max(1);
    let total = data.len();
    let base = ChunkBase(data.as_mut_ptr());
    let base = &base;
    run(total.div_ceil(len), &|i| {
        let start = i * len;
        let end = (start + len).min(total);
        // SAFETY: `run` calls each index once, so the ranges [start, end)
        // handed out are disjoint and inside `data`, whose mutable borrow
        // lasts until `run` has returned (it waits for every chunk).
        let chunk = unsafe { std::slice::from_raw_parts_mut(base.0.add(start), end - start) };
        f(i, chunk)
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_chunk_runs_once_even_from_several_threads_at_once() {
        let hits: Vec<AtomicUsize> = (0..97).map(|_| AtomicUsize::new(0)).collect();
        std::thread::scope(|sc| {
            for _ in 0..3 {
                sc.spawn(|| {
                    for round in 0..200 {
                        let n = 1 + round % 97;
                        run(n, &|i| {
                            hits[i].fetch_add(1, SeqCst);
                        });
                        // Nested use from inside a job takes the fallback.
                        if round % 50 == 0 {
                            run(2, &|_| run(3, &|_| {}));
                        }
                    }
                });
            }
        });
        let total: usize = hits.iter().map(|h| h.load(SeqCst)).sum();
        let want: usize = 3 * (0..200).map(|r| 1 + r % 97).sum::<usize>();
        assert_eq!(total, want);
    }

    #[test]
    fn a_panicking_chunk_panics_the_caller_and_the_team_goes_on() {
        let caught = std::panic::catch_unwind(|| {
            run(4, &|i| {
                if i == 3 {
                    panic!("chunk 3");
                }
            })
        });
        assert!(caught.is_err());
        let sum = AtomicUsize::new(0);
        run(4, &|i| {
            sum.fetch_add(i, SeqCst);
        });
        assert_eq!(sum.load(SeqCst), 6);
    }

    #[test]
    fn helpers_park_and_wake_again() {
        let sum = AtomicUsize::new(0);
        run(8, &|i| {
            sum.fetch_add(i, SeqCst);
        });
        std::thread::sleep(SPIN * 4);
        run(8, &|i| {
            sum.fetch_add(i, SeqCst);
        });
        assert_eq!(sum.load(SeqCst), 2 * 28);
    }

    #[test]
    fn chunks_of_a_mutable_slice_are_each_handed_out_once_with_their_index() {
        std::thread::scope(|sc| {
            for t in 0..3usize {
                sc.spawn(move || {
                    for len in [1usize, 7, 64, 100, 1000] {
                        let mut data = vec![0usize; 1000 + t];
                        for_chunks_mut(&mut data, len, &|i, chunk| {
                            assert!(chunk.len() == len || (i + 1) * len >= 1000 + t, "only the last chunk is short");
                            for (j, v) in chunk.iter_mut().enumerate() {
                                *v += i * len + j + 1;
                            }
                        });
                        assert!(
                            data.iter().enumerate().all(|(at, &v)| v == at + 1),
                            "chunk {len}: each element written once, at its own index"
                        );
                    }
                });
            }
        });
    }
}
