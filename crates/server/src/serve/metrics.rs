//! `/metrics`: Prometheus text format with vLLM's metric names, labels and
//! buckets (so vLLM's Grafana dashboards work), plus `vellum:` extras.
//!
//! Gauges and engine counters are read from [`EngineStats`] at scrape time;
//! request histograms and the per-reason success counter are recorded by the
//! HTTP layer as requests finish.

use std::fmt::Write;
use std::sync::Mutex;
use vellum_engine::EngineStats;
use vellum_scheduler::FinishReason;

/// vLLM's `time_to_first_token_seconds` buckets.
const TTFT_BUCKETS: &[f64] =
    &[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0];
/// vLLM's `inter_token_latency_seconds` / `time_per_output_token_seconds` buckets.
const ITL_BUCKETS: &[f64] = &[0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
/// vLLM's request-latency buckets (e2e, queue time).
const REQUEST_LATENCY_BUCKETS: &[f64] =
    &[0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0];

/// The finish reasons vLLM labels `request_success_total` with.

#[derive(Clone, Debug)]
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self { bounds, counts: vec![0; bounds.len()], sum: 0.0, count: 0 }
    }

    fn observe(&mut self, v: f64) {
        if !v.is_finite() {
            return;
        }
        for (c, &b) in self.counts.iter_mut().zip(self.bounds) {
            if v <= b {
                *c += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }
}

fn token_buckets(max_model_len: usize) -> &'static [f64] {
    // vLLM's build_1_2_5_buckets(max_model_len).
    let mut v = Vec::new();
    let mut exp = 1.0f64;
    'outer: loop {
        for m in [1.0, 2.0, 5.0] {
            let b = m * exp;
            if b > max_model_len as f64 {
                break 'outer;
            }
            v.push(b);
        }
        exp *= 10.0;
    }
    Box::leak(v.into_boxed_slice())
}

struct Inner {
    ttft: Histogram,
    itl: Histogram,
    tpot: Histogram,
    e2e: Histogram,
    queue: Histogram,
    prompt_tokens: Histogram,
    generation_tokens: Histogram,
    success: [u64; 3],
    prompt_tokens_total: u64,
    rejected_busy: u64,
    http_requests: u64,
}

/// What one finished request contributes.
#[derive(Clone, Debug, Default)]
pub struct RequestRecord {
    /// Seconds from arrival to the first token (None: none came).
    pub ttft: Option<f64>,
    /// Seconds from arrival to the first token, less the engine steps that
    /// produced it (see [`Metrics`]).
    pub queue_time: Option<f64>,
    /// Gaps between successive tokens.
    pub inter_token: Vec<f64>,
    /// Seconds from arrival to the end.
    pub e2e: f64,
    /// Prompt tokens (all prompts of the request).
    pub prompt_tokens: usize,
    /// Output tokens returned.
    pub generation_tokens: usize,
    /// Why it ended (`None` counts as aborted).
    pub finish_reason: Option<FinishReason>,
}

/// The server's metrics.
pub struct Metrics {
    model_name: String,
    inner: Mutex<Inner>,
}

impl Metrics {
    /// Empty metrics for `model_name` (the label of every series).
    pub fn new(model_name: &str, max_model_len: usize) -> Self {
        let tb = token_buckets(max_model_len);
        Self {
            model_name: model_name.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n"),
            inner: Mutex::new(Inner {
                ttft: Histogram::new(TTFT_BUCKETS),
                itl: Histogram::new(ITL_BUCKETS),
                tpot: Histogram::new(ITL_BUCKETS),
                e2e: Histogram::new(REQUEST_LATENCY_BUCKETS),
                queue: Histogram::new(REQUEST_LATENCY_BUCKETS),
                prompt_tokens: Histogram::new(tb),
                generation_tokens: Histogram::new(tb),
                success: [0; 3],
                prompt_tokens_total: 0,
                rejected_busy: 0,
                http_requests: 0,
            }),
        }
    }

    /// Records a finished (or aborted) request.
    pub fn record(&self, r: &RequestRecord) {
        let Ok(mut m) = self.inner.lock() else { return };
        if let Some(t) = r.ttft {
            m.ttft.observe(t);
            m.prompt_tokens_total += r.prompt_tokens as u64;
        }
        if let Some(q) = r.queue_time {
            m.queue.observe(q);
        }
        for &g in &r.inter_token {
            m.itl.observe(g);
        }
        let reason = r.finish_reason.unwrap_or(FinishReason::Abort);
        m.success[reason.index()] += 1;
        if reason != FinishReason::Abort {
            m.e2e.observe(r.e2e);
            m.prompt_tokens.observe(r.prompt_tokens as f64);
            m.generation_tokens.observe(r.generation_tokens as f64);
            if let (Some(t), true) = (r.ttft, r.generation_tokens > 1) {
                m.tpot.observe((r.e2e - t) / (r.generation_tokens - 1) as f64);
            }
        }
    }

    /// Counts a request refused with 503 (queue full).
    pub fn rejected_busy(&self) {
        if let Ok(mut m) = self.inner.lock() {
            m.rejected_busy += 1;
        }
    }

    /// Counts an HTTP request to a generation or embeddings endpoint.
    pub fn http_request(&self) {
        if let Ok(mut m) = self.inner.lock() {
            m.http_requests += 1;
        }
    }

    /// The exposition text.
    pub fn render(&self, s: &EngineStats) -> String {
        let labels = format!("model_name=\"{}\",engine=\"0\"", self.model_name);
        let mut out = String::with_capacity(16 * 1024);
        let mut metric = |name: &str, kind: &str, help: &str, value: f64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {}", fmt(value));
        };
        let kv = &s.kv;
        let usage = if kv.num_blocks == 0 { 0.0 } else { kv.num_used_blocks as f64 / kv.num_blocks as f64 };
        metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", s.num_running as f64);
        metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", s.num_waiting as f64);
        metric("vllm:num_requests_swapped", "gauge", "Number of requests swapped to CPU.", s.num_swapped as f64);
        metric(
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage (blocks held by live requests; cached blocks nobody holds count as free).",
            usage,
        );
        metric("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.", s.num_preemptions as f64);
        metric("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", s.counters.generation_tokens as f64);
        metric(
            "vllm:prefix_cache_queries_total",
            "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
            kv.prefix_cache_queries as f64,
        );
        metric(
            "vllm:prefix_cache_hits_total",
            "counter",
            "Prefix cache hits, in terms of number of cached tokens.",
            kv.prefix_cache_hits as f64,
        );
        // Speculative decoding, as vLLM names it (zero without a proposer).
        let sd = &s.spec_decode;
        metric("vllm:spec_decode_num_drafts_total", "counter", "Number of spec decoding drafts.", sd.num_drafts as f64);
        metric("vllm:spec_decode_num_draft_tokens_total", "counter", "Number of draft tokens.", sd.num_draft_tokens as f64);
        metric("vllm:spec_decode_num_accepted_tokens_total", "counter", "Number of accepted tokens.", sd.num_accepted_tokens as f64);
        let mut per_pos = String::from(
            "# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.\n\
             # TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter\n",
        );
        for (pos, n) in sd.num_accepted_tokens_per_pos.iter().enumerate().take_while(|(pos, n)| **n > 0 || *pos == 0) {
            let _ = writeln!(per_pos, "vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position=\"{pos}\"}} {n}");
        }
        // Vellum's extras: where the KV memory goes (paper §3, Fig. 2).
        let used_slots = (kv.num_used_blocks * kv.block_size) as f64;
        let waste = if used_slots == 0.0 { 0.0 } else { (kv.num_reserved_slots + kv.num_internal_frag_slots) as f64 / used_slots };
        metric("vellum:kv_cache_blocks", "gauge", "KV blocks in the device pool.", kv.num_blocks as f64);
        metric("vellum:kv_cache_used_blocks", "gauge", "KV blocks held by live requests.", kv.num_used_blocks as f64);
        metric(
            "vellum:kv_cache_cached_free_blocks",
            "gauge",
            "Free KV blocks that still hold a reusable cached prefix.",
            kv.num_cached_free_blocks as f64,
        );
        metric("vellum:kv_cache_filled_slots", "gauge", "Token slots of used blocks holding a token's KV.", kv.num_filled_slots as f64);
        metric(
            "vellum:kv_cache_reserved_slots",
            "gauge",
            "Empty slots of used blocks reserved for tokens still to come.",
            kv.num_reserved_slots as f64,
        );
        metric(
            "vellum:kv_cache_internal_fragmentation_slots",
            "gauge",
            "Empty slots of used blocks that no token will fill.",
            kv.num_internal_frag_slots as f64,
        );
        metric("vellum:kv_cache_waste_perc", "gauge", "Reserved plus fragmented slots over the slots of used blocks.", waste);
        metric(
            "vellum:kv_cache_logical_blocks",
            "gauge",
            "Sum of block-table lengths over live sequences (blocks used without sharing).",
            kv.num_logical_blocks as f64,
        );
        metric(
            "vellum:kv_cache_shared_blocks_saved",
            "gauge",
            "Blocks saved by sharing (parallel samples, beams, prefixes): logical minus used.",
            kv.num_logical_blocks.saturating_sub(kv.num_used_blocks) as f64,
        );
        metric(
            "vellum:requests_aborted_by_disconnect_total",
            "counter",
            "Requests aborted because the client went away.",
            s.num_aborted_by_disconnect as f64,
        );
        metric(
            "vellum:requests_aborted_slow_reader_total",
            "counter",
            "Requests aborted because their client stopped reading a stream whose buffer filled.",
            s.num_aborted_slow_reader as f64,
        );
        metric("vellum:engine_steps_total", "counter", "Engine steps run.", s.counters.num_steps as f64);
        metric(
            "vellum:engine_decode_steps_total",
            "counter",
            "Of the engine steps, the uniform decode steps (one token and one logits row a sequence).",
            s.counters.decode_steps as f64,
        );
        metric(
            "vellum:engine_decode_execute_seconds_total",
            "counter",
            "Of the executor's seconds, those of uniform decode steps.",
            s.counters.decode_execute_s,
        );
        let c = &s.counters;
        let other = (s.loop_busy_s - c.schedule_s - c.execute_s - c.sample_s).max(0.0);
        for (phase, seconds, what) in [
            ("schedule", c.schedule_s, "scheduling and building the batch (draft proposals included)"),
            ("execute", c.execute_s, "the executor (the forward pass)"),
            ("sample", c.sample_s, "sampling and applying the samples"),
            ("output", other, "on the rest of a step: its token deltas, handing them to the streams, ending finished ones"),
        ] {
            metric(&format!("vellum:engine_{phase}_seconds_total"), "counter", &format!("Engine loop seconds spent {what}."), seconds);
        }
        metric(
            "vellum:prompt_tokens_computed_total",
            "counter",
            "Prompt tokens computed (prefix-cache hits excluded).",
            s.counters.prompt_tokens as f64,
        );
        let Ok(m) = self.inner.lock() else { return out };
        metric("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", m.prompt_tokens_total as f64);
        metric(
            "vellum:requests_rejected_busy_total",
            "counter",
            "Requests refused with 503 because the queue was full.",
            m.rejected_busy as f64,
        );
        metric("vellum:http_generation_requests_total", "counter", "HTTP requests to the generation endpoints.", m.http_requests as f64);
        let _ = writeln!(
            out,
            "# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter"
        );
        for (reason, v) in FinishReason::ALL.iter().zip(m.success) {
            let _ = writeln!(out, "vllm:request_success_total{{{labels},finished_reason=\"{}\"}} {v}", reason.as_str());
        }
        let hists: [(&str, &str, &Histogram); 7] = [
            ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", &m.ttft),
            ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", &m.itl),
            ("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.", &m.tpot),
            ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", &m.e2e),
            (
                "vllm:request_queue_time_seconds",
                "Histogram of time spent waiting before the first engine step that ran the request (from arrival to the first engine step that computed any of its tokens).",
                &m.queue,
            ),
            ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", &m.prompt_tokens),
            ("vllm:request_generation_tokens", "Number of generation tokens processed.", &m.generation_tokens),
        ];
        for (name, help, h) in hists {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
            for (b, c) in h.bounds.iter().zip(&h.counts) {
                let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{}\"}} {c}", fmt(*b));
            }
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", h.count);
            let _ = writeln!(out, "{name}_sum{{{labels}}} {}", fmt(h.sum));
            let _ = writeln!(out, "{name}_count{{{labels}}} {}", h.count);
        }
        let name = "vellum:engine_step_execute_seconds";
        let _ = writeln!(
            out,
            "# HELP {name} Executor seconds of each engine step: kind=\"decode\" the uniform decode steps, kind=\"other\" the rest (prompt chunks, verifications, pooling).\n# TYPE {name} histogram"
        );
        for (kind, t) in [("decode", &s.counters.decode_step_times), ("other", &s.counters.other_step_times)] {
            let mut cumulative = 0;
            for (b, c) in vellum_engine::STEP_SECONDS_BUCKETS.iter().zip(&t.counts) {
                cumulative += c;
                let _ = writeln!(out, "{name}_bucket{{{labels},kind=\"{kind}\",le=\"{}\"}} {cumulative}", fmt(*b));
            }
            let _ = writeln!(out, "{name}_bucket{{{labels},kind=\"{kind}\",le=\"+Inf\"}} {}", t.count());
            let _ = writeln!(out, "{name}_sum{{{labels},kind=\"{kind}\"}} {}", fmt(t.sum_s));
            let _ = writeln!(out, "{name}_count{{{labels},kind=\"{kind}\"}} {}", t.count());
        }
        out.push_str(&per_pos);
        out
    }
}

fn fmt(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.1}")
    } else {
        format!("{v}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_and_sum_counts() {
        let m = Metrics::new("m", 2048);
        m.record(&RequestRecord {
            ttft: Some(0.03),
            queue_time: Some(0.01),
            inter_token: vec![0.02, 0.2],
            e2e: 0.4,
            prompt_tokens: 7,
            generation_tokens: 3,
            finish_reason: Some(FinishReason::Length),
        });
        m.record(&RequestRecord { finish_reason: Some(FinishReason::Abort), e2e: 9.0, ..Default::default() });
        let text = m.render(&EngineStats::default());
        assert!(text.contains("vllm:time_to_first_token_seconds_bucket{model_name=\"m\",engine=\"0\",le=\"0.02\"} 0\n"));
        assert!(text.contains("vllm:time_to_first_token_seconds_bucket{model_name=\"m\",engine=\"0\",le=\"0.04\"} 1\n"));
        assert!(text.contains("vllm:time_to_first_token_seconds_count{model_name=\"m\",engine=\"0\"} 1\n"));
        assert!(text.contains("vllm:inter_token_latency_seconds_count{model_name=\"m\",engine=\"0\"} 2\n"));
        assert!(text.contains("vllm:request_success_total{model_name=\"m\",engine=\"0\",finished_reason=\"length\"} 1\n"));
        assert!(text.contains("vllm:request_success_total{model_name=\"m\",engine=\"0\",finished_reason=\"abort\"} 1\n"));
        // Aborted requests stay out of the latency histograms.
        assert!(text.contains("vllm:e2e_request_latency_seconds_count{model_name=\"m\",engine=\"0\"} 1\n"));
        assert!(text.contains("vllm:prompt_tokens_total{model_name=\"m\",engine=\"0\"} 7.0\n"));
        assert!(text.contains("vllm:request_prompt_tokens_bucket{model_name=\"m\",engine=\"0\",le=\"2000.0\"} 1\n"));
    }

    #[test]
    fn speculative_decoding_counters_carry_vllms_names() {
        let mut s = EngineStats::default();
        let text = Metrics::new("m", 64).render(&s);
        assert!(text.contains("vllm:spec_decode_num_drafts_total{model_name=\"m\",engine=\"0\"} 0.0\n"), "{text}");
        s.spec_decode.num_drafts = 3;
        s.spec_decode.num_draft_tokens = 12;
        s.spec_decode.num_accepted_tokens = 5;
        s.spec_decode.num_accepted_tokens_per_pos[..3].copy_from_slice(&[3, 1, 1]);
        let text = Metrics::new("m", 64).render(&s);
        for line in [
            "vllm:spec_decode_num_draft_tokens_total{model_name=\"m\",engine=\"0\"} 12.0",
            "vllm:spec_decode_num_accepted_tokens_total{model_name=\"m\",engine=\"0\"} 5.0",
            "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter",
            "vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name=\"m\",engine=\"0\",position=\"2\"} 1",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
        assert!(!text.contains("position=\"3\""), "positions past the last accepted one are left out");
    }

    #[test]
    fn step_times_are_a_cumulative_histogram_by_kind() {
        let mut s = EngineStats::default();
        for t in [0.004, 0.012, 0.012, 3.0] {
            s.counters.decode_step_times.observe(t);
        }
        s.counters.other_step_times.observe(0.04);
        let text = Metrics::new("m", 64).render(&s);
        for line in [
            "# TYPE vellum:engine_step_execute_seconds histogram",
            "vellum:engine_step_execute_seconds_bucket{model_name=\"m\",engine=\"0\",kind=\"decode\",le=\"0.005\"} 1\n",
            "vellum:engine_step_execute_seconds_bucket{model_name=\"m\",engine=\"0\",kind=\"decode\",le=\"0.015\"} 3\n",
            "vellum:engine_step_execute_seconds_bucket{model_name=\"m\",engine=\"0\",kind=\"decode\",le=\"1.0\"} 3\n",
            "vellum:engine_step_execute_seconds_bucket{model_name=\"m\",engine=\"0\",kind=\"decode\",le=\"+Inf\"} 4\n",
            "vellum:engine_step_execute_seconds_count{model_name=\"m\",engine=\"0\",kind=\"other\"} 1\n",
            "vellum:engine_step_execute_seconds_bucket{model_name=\"m\",engine=\"0\",kind=\"other\",le=\"0.03\"} 0\n",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
    }

    #[test]
    fn kv_usage_counts_only_held_blocks() {
        let mut s = EngineStats::default();
        s.kv.num_blocks = 10;
        s.kv.num_used_blocks = 4;
        s.kv.num_cached_free_blocks = 5;
        let text = Metrics::new("m", 64).render(&s);
        assert!(text.contains("vllm:kv_cache_usage_perc{model_name=\"m\",engine=\"0\"} 0.4\n"), "{text}");
    }
}
