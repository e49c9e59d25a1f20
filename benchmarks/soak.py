#!/usr/bin/env python3
"""Soak test: mixed load against a running `vellum serve`, then a report.

    python3 benchmarks/soak.py --port PORT --key KEY --model NAME --pid PID \
        --duration 1800 [--concurrency 16] [--json out.json] [--svg rss.svg]

For `--duration` seconds, `--concurrency` clients loop over a random mix:
streaming and plain completions, chat with a shared system prompt (prefix
caching) and stop strings, n = 2 and best_of = 3, beam search, clients that
hang up mid-stream or before the answer, and invalid requests (malformed
JSON, out-of-range parameters) that must get a 400. Every 10 s it records the
server's RSS (from /proc/PID/status) and the latencies of the last window.

Afterwards, once the server is idle: nothing running or waiting, every KV
block free, and the request counters add up (nothing leaked). Exits non-zero
if any request got an unexpected answer or anything leaked. Standard library
only (raw HTTP/1.1 on asyncio), so it runs wherever python3 does.
"""
import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import time

ARGS = None
SYSTEM = "You are a careful assistant. Answer in one short sentence. " * 4
WORDS = "the cat dog river mountain city light dark small large quick slow red blue green old new".split()


async def exchange(method, path, body=None, raw=None, hang_up_after=None):
    """One request. Returns (status, body bytes, chunks read); with
    `hang_up_after`, closes the socket after that many body chunks."""
    reader, writer = await asyncio.open_connection("127.0.0.1", ARGS.port)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else b"")
    head = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {ARGS.key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n")
    writer.write(head.encode() + data)
    await writer.drain()
    try:
        if hang_up_after == 0:
            return None, b"", 0
        status = int((await reader.readline()).split()[1])
        headers = {}
        while True:
            line = (await reader.readline()).decode().strip()
            if not line:
                break
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        out, chunks = b"", 0
        if headers.get("transfer-encoding") == "chunked":
            while True:
                size = int((await reader.readline()).strip() or b"0", 16)
                if size == 0:
                    break
                out += (await reader.readexactly(size + 2))[:-2]
                chunks += 1
                if hang_up_after is not None and chunks >= hang_up_after:
                    return status, out, chunks
        else:
            out = await reader.read()
        return status, out, chunks
    finally:
        writer.close()


def prompt(n_words):
    return " ".join(random.choice(WORDS) for _ in range(n_words))


def pick():
    """(kind, method, path, body, raw, hang_up_after, expected status)."""
    r = random.random()
    m = ARGS.model
    if r < 0.25:
        hang = random.choice([None, None, None, 2])
        return ("stream" if hang is None else "stream_hangup", "POST", "/v1/completions",
                {"model": m, "prompt": prompt(random.randint(3, 40)), "max_tokens": random.randint(4, 32),
                 "stream": True, "temperature": 0.8, "seed": random.randint(0, 9999)}, None, hang, 200)
    if r < 0.40:
        return ("chat_prefix_stop", "POST", "/v1/chat/completions",
                {"model": m, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt(8)}],
                 "max_tokens": 24, "temperature": 0, "stop": [".", "\n\n"]}, None, None, 200)
    if r < 0.55:
        extra = random.choice([{"n": 2}, {"best_of": 3}, {"n": 2, "logprobs": 3}])
        return ("parallel", "POST", "/v1/completions",
                dict({"model": m, "prompt": prompt(12), "max_tokens": 12, "temperature": 1.0}, **extra), None, None, 200)
    if r < 0.62:
        return ("beam", "POST", "/v1/completions",
                {"model": m, "prompt": prompt(10), "max_tokens": 8, "use_beam_search": True, "n": 2, "temperature": 0},
                None, None, 200)
    if r < 0.72:
        return ("hangup_before_answer", "POST", "/v1/completions",
                {"model": m, "prompt": prompt(30), "max_tokens": 32}, None, 0, None)
    if r < 0.85:
        bad = random.choice([
            (None, b"{\"prompt\": "),
            ({"model": m, "prompt": "x", "max_tokens": -1}, None),
            ({"model": m, "prompt": "x", "logprobs": 50}, None),
            ({"model": m, "prompt": "x", "temperature": "hot"}, None),
            ({"model": m, "messages": 3}, None),
        ])
        path = "/v1/chat/completions" if bad[0] and "messages" in bad[0] else "/v1/completions"
        return ("invalid", "POST", path, bad[0], bad[1], None, 400)
    return ("plain", "POST", "/v1/completions",
            {"model": m, "prompt": prompt(random.randint(3, 60)), "max_tokens": random.randint(1, 24), "temperature": 0},
            None, None, 200)


class Stats:
    def __init__(self):
        self.outcomes = {}
        self.unexpected = []
        self.window = []
        self.series = []  # (t, rss_mib, p50, p99, requests in window)


async def client(stats, deadline):
    while time.monotonic() < deadline:
        kind, method, path, body, raw, hang, expected = pick()
        t0 = time.monotonic()
        try:
            status, out, _ = await exchange(method, path, body, raw, hang)
        except Exception as e:  # a reset the server caused would show here
            stats.unexpected.append((kind, repr(e)))
            continue
        dt = time.monotonic() - t0
        key = kind
        if expected is not None and status != expected:
            stats.unexpected.append((kind, status, out[:200]))
            key = kind + "_unexpected"
        elif expected == 200 and kind == "stream" and b"data: [DONE]" not in out:
            stats.unexpected.append((kind, "stream without [DONE]", out[-200:]))
            key = kind + "_unexpected"
        stats.outcomes[key] = stats.outcomes.get(key, 0) + 1
        if expected == 200 and hang is None:
            stats.window.append(dt)


def rss_mib():
    try:
        for line in open(f"/proc/{ARGS.pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


async def sampler(stats, start, deadline):
    while time.monotonic() < deadline:
        await asyncio.sleep(min(10, max(0.1, deadline - time.monotonic())))
        w, stats.window = stats.window, []
        p50 = statistics.median(w) if w else float("nan")
        p99 = sorted(w)[min(len(w) - 1, int(len(w) * 0.99))] if w else float("nan")
        stats.series.append((round(time.monotonic() - start), rss_mib(), p50, p99, len(w)))
        t, rss, a, b, n = stats.series[-1]
        print(f"t={t:5d}s rss={rss:7.1f} MiB  p50={a:6.2f}s p99={b:6.2f}s  ({n} requests)", flush=True)


def metric(text, name):
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


async def idle_state():
    """Metrics once nothing runs or waits (or after 60 s)."""
    for _ in range(120):
        status, out, _ = await exchange("GET", "/metrics")
        text = out.decode()
        if metric(text, "vllm:num_requests_running") == 0 and metric(text, "vllm:num_requests_waiting") == 0:
            return text
        await asyncio.sleep(0.5)
    return text


def svg(series, path):
    pts = [(t, r) for t, r, *_ in series if r == r]
    if not pts:
        return
    w, h, pad = 640, 240, 40
    tmax = max(t for t, _ in pts) or 1
    rmax = max(r for _, r in pts) * 1.2 or 1
    xy = " ".join(f"{pad + t / tmax * (w - 2 * pad):.1f},{h - pad - r / rmax * (h - 2 * pad):.1f}" for t, r in pts)
    open(path, "w").write(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">'
        f'<rect width="{w}" height="{h}" fill="white"/>'
        f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>'
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>'
        f'<polyline points="{xy}" fill="none" stroke="#1f77b4" stroke-width="2"/>'
        f'<text x="{w / 2}" y="{h - 8}" text-anchor="middle">seconds ({tmax} s soak)</text>'
        f'<text x="12" y="{pad - 12}">server RSS, MiB (max {max(r for _, r in pts):.0f})</text>'
        f'<text x="{pad - 4}" y="{pad + 4}" text-anchor="end">{rmax:.0f}</text>'
        f'<text x="{pad - 4}" y="{h - pad}" text-anchor="end">0</text></svg>\n')


async def main():
    stats = Stats()
    start = time.monotonic()
    deadline = start + ARGS.duration
    await asyncio.gather(sampler(stats, start, deadline), *(client(stats, deadline) for _ in range(ARGS.concurrency)))
    text = await idle_state()
    running, waiting = metric(text, "vllm:num_requests_running"), metric(text, "vllm:num_requests_waiting")
    kv = metric(text, "vllm:kv_cache_usage_perc")
    status, out, _ = await exchange("POST", "/v1/completions", {"model": ARGS.model, "prompt": "still there?", "max_tokens": 2})
    report = {
        "duration_s": ARGS.duration, "concurrency": ARGS.concurrency, "outcomes": stats.outcomes,
        "unexpected": len(stats.unexpected), "idle_running": running, "idle_waiting": waiting, "idle_kv_usage": kv,
        "after_status": status, "rss_mib": [s[1] for s in stats.series], "series": stats.series,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "series"}))
    for u in stats.unexpected[:10]:
        print("unexpected:", u)
    if ARGS.json:
        json.dump(report, open(ARGS.json, "w"), indent=1)
    if ARGS.svg:
        svg(stats.series, ARGS.svg)
    ok = not stats.unexpected and running == 0 and waiting == 0 and kv == 0 and status == 200
    rss = [s[1] for s in stats.series if s[1] == s[1]]
    if len(rss) >= 4 and ARGS.max_rss_growth > 0:
        # RSS must not keep growing: over the second half of the run it may
        # grow by the given factor at most (the first half is warm-up: the
        # allocator's arenas and caches reach their working size).
        mid = rss[len(rss) // 2]
        ok &= rss[-1] <= mid * ARGS.max_rss_growth
        print(f"rss: {rss[0]:.1f} MiB at the first sample, {mid:.1f} MiB halfway, {rss[-1]:.1f} MiB at the end")
    print("SOAK PASSED" if ok else "SOAK FAILED", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--key", default="")
    p.add_argument("--model", required=True)
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--duration", type=float, default=1800)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-rss-growth", type=float, default=1.1)
    p.add_argument("--json")
    p.add_argument("--svg")
    p.add_argument("--seed", type=int, default=0)
    ARGS = p.parse_args()
    random.seed(ARGS.seed)
    asyncio.run(main())
