//! [`EngineClient`]: the engine loop on its own thread, token in / token out
//! over channels (thesis §4.1's EngineCoreClient).
//!
//! ```text
//!  callers ──Command (std mpsc)──▶ engine thread: loop { drain commands; step; route }
//!     ▲                                   │
//!     └──RequestEvent (tokio mpsc, one per request)──┘
//! ```
//!
//! Any number of callers (threads or async tasks) submit requests and read
//! their events from a [`RequestStream`]. Dropping a stream before its
//! request finished aborts the request: a client that disconnects has its
//! KV blocks freed before the next step runs.
//!
//! If the engine thread panics (a bug, or a backend that panics), every
//! live stream still gets a final [`RequestEvent::Error`] — the streams'
//! senders are dropped by a guard that sends it while unwinding — and
//! [`EngineClient::is_alive`] turns false, so a server can report itself
//! unhealthy and exit instead of leaving clients waiting. A test-only hook
//! injects such a panic: `VELLUM_FAULT_INJECTION=panic-at-step:N`.

use crate::engine_core::{EngineCore, EngineCounters};
use crate::error::Error;
use crate::outputs::{RequestOutput, SequenceDelta};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc as tmpsc;
use vellum_base::{IdMap, KvCacheStats, ModelExecutor, RequestId, SamplingParams, TokenId};
use vellum_scheduler::FinishReason;

/// How often the engine loop reads the KV cache's accounting for
/// [`EngineStats::kv`] while steps run.
const KV_STATS_INTERVAL: Duration = Duration::from_millis(50);

/// What a request's stream carries.
#[derive(Clone, Debug)]
pub enum RequestEvent {
    /// New tokens of one sequence.
    Delta(SequenceDelta),
    /// The request ended; the final outputs (with every token).
    Finished(RequestOutput),
    /// The request ended unfinished: the engine failed while running it, or
    /// its reader fell too far behind. The message says which.
    Error(String),
}

/// A snapshot of the engine, refreshed after every step (for metrics).
#[derive(Clone, Debug, Default)]
pub struct EngineStats {
    /// Requests running (holding KV blocks).
    pub num_running: usize,
    /// Requests waiting (new, or preempted by recompute).
    pub num_waiting: usize,
    /// Requests swapped out to host memory.
    pub num_swapped: usize,
    /// KV-cache accounting.
    pub kv: KvCacheStats,
    /// Preemptions so far.
    pub num_preemptions: u64,
    /// Steps, tokens and phase times so far.
    pub counters: EngineCounters,
    /// Requests aborted because their caller went away.
    pub num_aborted_by_disconnect: u64,
    /// Requests aborted because their caller stopped reading: more than
    /// the stream buffer's events were waiting (a stalled SSE client).
    pub num_aborted_slow_reader: u64,
    /// Finished requests by reason, indexed by `FinishReason::index`.
    pub finished_by_reason: [u64; 3],
    /// Speculative decoding's counters (zero without a proposer).
    pub spec_decode: crate::speculative::SpecDecodeCounters,
    /// Seconds the engine loop spent on steps: the step itself (its
    /// schedule, execute and sample shares are in `counters`; the rest is
    /// its token deltas) and handing them to the requests' streams (the
    /// server detokenizes on its own tasks). Idle waits are not counted.
    pub loop_busy_s: f64,
}

enum Command {
    Add {
        prompt: Vec<TokenId>,
        params: Box<SamplingParams>,
        priority: i64,
        events: tmpsc::Sender<RequestEvent>,
        reply: tokio::sync::oneshot::Sender<Result<RequestId, Error>>,
    },
    Finish(RequestId, FinishReason, bool),
    FinishSequence(RequestId, usize, FinishReason),
    Shutdown,
}

/// Events a request's stream may hold unread before the request is
/// aborted (one event per sequence per step, so a reader this many steps
/// behind; ~100 bytes each). The last slot is kept for the final event.
pub const STREAM_BUFFER_EVENTS: usize = 4096;

struct Shared {
    stats: Mutex<EngineStats>,
    num_waiting: AtomicU64,
    /// False once the engine thread has ended (shutdown or panic).
    alive: AtomicBool,
}

/// The live requests' event senders. Dropped while the engine thread
/// unwinds from a panic, it ends every stream with an error, and marks the
/// engine dead either way.
struct Streams {
    senders: IdMap<RequestId, tmpsc::Sender<RequestEvent>>,
    shared: Arc<Shared>,
}

impl Drop for Streams {
    fn drop(&mut self) {
        self.shared.alive.store(false, Ordering::SeqCst);
        if std::thread::panicking() {
            tracing::error!(live_requests = self.senders.len(), "the engine thread panicked; failing every live request");
            for tx in self.senders.values() {
                // A delta never takes a stream's last slot: this fits.
                let _ = tx.try_send(RequestEvent::Error("the engine failed (internal error); the request was aborted".into()));
            }
        }
    }
}

/// A fault the test-only hook injects at an engine step (1-based).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// `VELLUM_FAULT_INJECTION=panic-at-step:N`: the engine thread panics
    /// just before its N-th step.
    Panic(u64),
    /// `VELLUM_FAULT_INJECTION=error-at-step:N`: the N-th step's forward
    /// pass reports a backend error.
    Error(u64),
}

fn injected_fault() -> Option<Fault> {
    let v = std::env::var("VELLUM_FAULT_INJECTION").ok()?;
    let (kind, n) = v.split_once(':')?;
    let n = n.trim().parse().ok()?;
    let fault = match kind {
        "panic-at-step" => Fault::Panic(n),
        "error-at-step" => Fault::Error(n),
        _ => return None,
    };
    tracing::warn!(step = n, kind, "VELLUM_FAULT_INJECTION: a fault will be injected (a test hook)");
    Some(fault)
}

/// A handle to the engine thread. Cheap to clone; the thread stops when
/// [`EngineClient::shutdown`] is called or the last handle is dropped.
#[derive(Clone)]
pub struct EngineClient {
    commands: mpsc::Sender<Command>,
    shared: Arc<Shared>,
    thread: Arc<Mutex<Option<std::thread::JoinHandle<()>>>>,
    /// Capacity of each request's event stream.
    buffer: usize,
    /// The engine's EOS tokens.
    eos_token_ids: Arc<[TokenId]>,
}

impl EngineClient {
    /// Moves `engine` onto a new thread that steps it while there is work.
    pub fn spawn<E: ModelExecutor + Send + 'static>(engine: EngineCore<E>) -> Self {
        Self::spawn_with_stream_buffer(engine, STREAM_BUFFER_EVENTS)
    }

    /// [`EngineClient::spawn`] with streams that hold at most `events`
    /// unread events (at least 2): a request whose reader falls that far
    /// behind is aborted, its blocks freed, and its stream ends with an
    /// [`RequestEvent::Error`] saying so. Memory per stream stays bounded
    /// and one stalled client never holds up the others.
    pub fn spawn_with_stream_buffer<E: ModelExecutor + Send + 'static>(engine: EngineCore<E>, events: usize) -> Self {
        let (tx, rx) = mpsc::channel();
        let buffer = events.max(2);
        let eos_token_ids: Arc<[TokenId]> = engine.eos_token_ids().into();
        let shared =
            Arc::new(Shared { stats: Mutex::new(EngineStats::default()), num_waiting: AtomicU64::new(0), alive: AtomicBool::new(true) });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("vellum-engine".into())
            .spawn(move || engine_loop(engine, rx, s))
            .expect("spawning the engine thread");
        Self { commands: tx, shared, thread: Arc::new(Mutex::new(Some(thread))), buffer, eos_token_ids }
    }

    /// The tokens that end a sequence unless `ignore_eos` (for an
    /// [`crate::OutputProcessor`]).
    pub fn eos_token_ids(&self) -> &[TokenId] {
        &self.eos_token_ids
    }

    /// Queues a request; its tokens arrive on the returned stream. Errors
    /// (invalid parameters, prompt too long) are returned here, before any
    /// stream exists. The engine takes new requests between steps, so this
    /// waits up to one step: async callers use
    /// [`EngineClient::add_request_async`].
    pub fn add_request(&self, prompt: Vec<TokenId>, params: SamplingParams, priority: i64) -> Result<RequestStream, Error> {
        let (reply_rx, stream) = self.send_add(prompt, params, priority)?;
        let id = reply_rx.blocking_recv().map_err(|_| Error::Unsupported("the engine has shut down"))??;
        Ok(stream(id))
    }

    /// [`EngineClient::add_request`] for async callers: awaits the engine's
    /// answer without blocking a runtime thread.
    pub async fn add_request_async(&self, prompt: Vec<TokenId>, params: SamplingParams, priority: i64) -> Result<RequestStream, Error> {
        let (reply_rx, stream) = self.send_add(prompt, params, priority)?;
        let id = reply_rx.await.map_err(|_| Error::Unsupported("the engine has shut down"))??;
        Ok(stream(id))
    }

    #[allow(clippy::type_complexity)]
    fn send_add(
        &self,
        prompt: Vec<TokenId>,
        params: SamplingParams,
        priority: i64,
    ) -> Result<(tokio::sync::oneshot::Receiver<Result<RequestId, Error>>, impl FnOnce(RequestId) -> RequestStream), Error> {
        let (events, rx) = tmpsc::channel(self.buffer);
        let (reply, reply_rx) = tokio::sync::oneshot::channel();
        self.commands
            .send(Command::Add { prompt, params: Box::new(params), priority, events, reply })
            .map_err(|_| Error::Unsupported("the engine has shut down"))?;
        let commands = self.commands.clone();
        Ok((reply_rx, move |id| RequestStream { id, events: rx, commands, done: false }))
    }

    /// Ends a request now (its blocks are freed before the next step).
    pub fn finish(&self, id: RequestId, reason: FinishReason) {
        let _ = self.commands.send(Command::Finish(id, reason, false));
    }

    /// Ends one output sequence (`index`) of a request (a stop string
    /// matched in one of several parallel samples): its blocks are freed
    /// before the next step; its siblings go on.
    pub fn finish_sequence(&self, id: RequestId, index: usize, reason: FinishReason) {
        let _ = self.commands.send(Command::FinishSequence(id, index, reason));
    }

    /// The latest engine snapshot.
    pub fn stats(&self) -> EngineStats {
        self.shared.stats.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Whether the engine thread is running: false after
    /// [`EngineClient::shutdown`] or a panic of the engine thread (every
    /// live stream then ended with an error).
    pub fn is_alive(&self) -> bool {
        self.shared.alive.load(Ordering::SeqCst)
    }

    /// Requests waiting, as of the last step.
    pub fn num_waiting(&self) -> u64 {
        self.shared.num_waiting.load(Ordering::Relaxed)
    }

    /// Stops the engine thread: requests still running are aborted (their
    /// streams get `Finished` with reason abort). Waits for the thread.
    pub fn shutdown(&self) {
        let _ = self.commands.send(Command::Shutdown);
        let handle = self.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(h) = handle {
            let _ = h.join();
        }
    }
}

/// The events of one request. Dropping it before `Finished` aborts the
/// request.
pub struct RequestStream {
    id: RequestId,
    events: tmpsc::Receiver<RequestEvent>,
    commands: mpsc::Sender<Command>,
    done: bool,
}

impl RequestStream {
    /// The engine's id for the request.
    pub fn request_id(&self) -> RequestId {
        self.id
    }

    /// The next event; `None` once the request finished.
    pub async fn next(&mut self) -> Option<RequestEvent> {
        if self.done {
            return None;
        }
        let ev = self.events.recv().await;
        self.note(&ev);
        ev
    }

    /// Blocking form of [`RequestStream::next`] (not in an async context).
    pub fn next_blocking(&mut self) -> Option<RequestEvent> {
        if self.done {
            return None;
        }
        let ev = self.events.blocking_recv();
        self.note(&ev);
        ev
    }

    /// Ends the request early with `reason` (e.g. a stop string matched).
    pub fn finish(&self, reason: FinishReason) {
        let _ = self.commands.send(Command::Finish(self.id, reason, false));
    }

    fn note(&mut self, ev: &Option<RequestEvent>) {
        if matches!(ev, None | Some(RequestEvent::Finished(_)) | Some(RequestEvent::Error(_))) {
            self.done = true;
        }
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.commands.send(Command::Finish(self.id, FinishReason::Abort, true));
        }
    }
}

/// Counts each finished request by its reason and sends it to its stream,
/// which then ends.
fn end_streams(
    finished: Vec<crate::outputs::RequestOutput>,
    streams: &mut IdMap<RequestId, tmpsc::Sender<RequestEvent>>,
    stats: &mut EngineStats,
) {
    for f in finished {
        let reason = f.outputs.iter().find_map(|o| o.finish_reason).unwrap_or(FinishReason::Abort);
        stats.finished_by_reason[reason.index()] += 1;
        if let Some(tx) = streams.remove(&f.request_id) {
            // The reserved last slot holds it (a delta never takes it).
            let _ = tx.try_send(RequestEvent::Finished(f));
        }
    }
}

fn engine_loop<E: ModelExecutor>(mut engine: EngineCore<E>, rx: mpsc::Receiver<Command>, shared: Arc<Shared>) {
    let mut guard = Streams { senders: IdMap::default(), shared: shared.clone() };
    let streams = &mut guard.senders;
    let mut stats = EngineStats::default();
    // When the KV cache's accounting was last read (it walks every block).
    let mut kv_read: Option<std::time::Instant> = None;
    let mut shutting_down = false;
    let (fault, mut steps) = (injected_fault(), 0u64);
    loop {
        // Idle: block for the next command. Busy: take what has arrived.
        let mut first = if engine.has_unfinished_requests() || shutting_down {
            None
        } else {
            match rx.recv_timeout(Duration::from_secs(3600)) {
                Ok(c) => Some(c),
                Err(mpsc::RecvTimeoutError::Timeout) => continue,
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
        };
        loop {
            let cmd = match first.take() {
                Some(c) => c,
                None => match rx.try_recv() {
                    Ok(c) => c,
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        shutting_down = true;
                        break;
                    }
                },
            };
            match cmd {
                Command::Add { prompt, params, priority, events, reply } => {
                    if shutting_down {
                        let _ = reply.send(Err(Error::Unsupported("the engine is shutting down")));
                        continue;
                    }
                    let r = engine.add_request_with_priority(prompt, *params, priority);
                    if let Ok(id) = r {
                        streams.insert(id, events);
                    }
                    let _ = reply.send(r);
                }
                Command::Finish(id, reason, disconnected) => {
                    if engine.finish_request(id, reason) && disconnected {
                        stats.num_aborted_by_disconnect += 1;
                    }
                }
                Command::FinishSequence(id, index, reason) => {
                    engine.finish_sequence(id, index, reason);
                }
                Command::Shutdown => shutting_down = true,
            }
        }
        if shutting_down {
            let live: Vec<RequestId> = streams.keys().copied().collect();
            for id in live {
                engine.finish_request(id, FinishReason::Abort);
            }
        }
        let busy_since = std::time::Instant::now();
        let stepped = engine.has_unfinished_requests();
        let outputs = if stepped {
            steps += 1;
            match fault {
                Some(Fault::Panic(n)) if n == steps => panic!("VELLUM_FAULT_INJECTION: injected panic at engine step {steps}"),
                Some(Fault::Error(n)) if n == steps => engine.fail_next_forward_pass(),
                _ => {}
            }
            engine.step_streaming()
        } else {
            Ok(crate::outputs::StepOutputs { deltas: Vec::new(), finished: engine.take_finished() })
        };
        match outputs {
            Ok(out) => {
                let mut gone = Vec::new();
                let mut stalled = Vec::new();
                for d in out.deltas {
                    let id = d.request_id;
                    if let Some(tx) = streams.get(&id) {
                        if tx.is_closed() {
                            gone.push(id);
                        } else if tx.capacity() <= 1 {
                            // Keep the last slot for the event that ends the stream.
                            stalled.push(id);
                        } else if tx.try_send(RequestEvent::Delta(d)).is_err() {
                            gone.push(id);
                        }
                    }
                }
                for id in stalled {
                    if engine.finish_request(id, FinishReason::Abort) {
                        stats.num_aborted_slow_reader += 1;
                        tracing::warn!(request_id = %id, "client stopped reading its stream; request aborted");
                    }
                    if let Some(tx) = streams.remove(&id) {
                        let msg = "the client fell too far behind reading this stream; the request was aborted";
                        let _ = tx.try_send(RequestEvent::Error(msg.into()));
                    }
                }
                end_streams(out.finished, streams, &mut stats);
                for id in gone {
                    // The receiver is gone without a Drop message: the
                    // caller of `add_request_async` went away before the
                    // engine's answer, so no stream was ever built.
                    if engine.finish_request(id, FinishReason::Abort) {
                        stats.num_aborted_by_disconnect += 1;
                    }
                }
            }
            Err(e) => {
                let msg = format!("the engine failed: {e}");
                // A failed forward pass ended its own requests and the
                // engine goes on; any other error fails every live request.
                let failed: Vec<RequestId> = match &e {
                    crate::Error::StepFailed { requests, .. } => requests.clone(),
                    _ => {
                        tracing::error!(error = %e, "engine step failed; failing every live request");
                        streams.keys().copied().collect()
                    }
                };
                for id in failed {
                    engine.finish_request(id, FinishReason::Abort);
                    if let Some(tx) = streams.remove(&id) {
                        let _ = tx.try_send(RequestEvent::Error(msg.clone()));
                    }
                }
                // Requests that ended otherwise meanwhile still get their end.
                end_streams(engine.take_finished(), streams, &mut stats);
            }
        }
        let queues = engine.queue_stats();
        stats.num_running = queues.num_running;
        stats.num_waiting = queues.num_waiting;
        stats.num_swapped = queues.num_swapped;
        if stepped {
            stats.loop_busy_s += busy_since.elapsed().as_secs_f64();
        }
        // The KV cache's accounting walks every block (200k on a large GPU):
        // read it at most every KV_STATS_INTERVAL while steps run, and once
        // more whenever the engine is idle, so /metrics is never further
        // behind than that.
        let idle = !engine.has_unfinished_requests();
        if idle || kv_read.is_none_or(|t| t.elapsed() >= KV_STATS_INTERVAL) {
            stats.kv = engine.kv_stats();
            kv_read = Some(std::time::Instant::now());
        }
        stats.num_preemptions = queues.num_preemptions;
        stats.counters = engine.counters();
        stats.spec_decode = engine.spec_decode_counters();
        shared.num_waiting.store(stats.num_waiting as u64, Ordering::Relaxed);
        if let Ok(mut s) = shared.stats.lock() {
            *s = stats.clone();
        }
        if shutting_down && !engine.has_unfinished_requests() && streams.is_empty() {
            return;
        }
    }
}
