"""A client that stops reading its stream, through a real socket.

Usage: python3 stalled_reader.py HOST PORT MODEL

The server runs with a small `--max-stream-buffer-events`. One client opens
a streaming completion on a socket with a tiny receive buffer and never
reads it. Meanwhile other clients' completions are answered; once the
stalled stream has filled the kernel's buffers, hyper's and the server's
bounded event buffer, the request is aborted
(`vellum:requests_aborted_slow_reader_total`), nothing runs and every KV
block is free while the stalled socket is still open; reading it then gives
the buffered chunks and an error event naming the slow reader.
Ends with 'N passed, M failed'.
"""
import json
import re
import socket
import sys
import time
import urllib.request

HOST, PORT, MODEL = sys.argv[1], int(sys.argv[2]), sys.argv[3]
BASE = f"http://{HOST}:{PORT}"
# Sixteen samples with 20 top logprobs each make every step's chunk ~10 KB,
# so that the kernel's socket buffers (auto-sized to MiBs on loopback) and
# hyper's (~400 KB) fill within a few hundred steps.
N, LOGPROBS, MAX_TOKENS = 16, 20, 400
passed = 0


def metrics():
    text = urllib.request.urlopen(BASE + "/metrics", timeout=60).read().decode()
    values = {}
    for line in text.splitlines():
        m = re.match(r"^([^#{ ]+)(\{[^}]*\})? (\S+)$", line)
        if m and 'le="' not in (m.group(2) or ""):
            values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(3))
    return values


def complete(prompt, max_tokens):
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(BASE + "/v1/completions", body, {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=120).read())


# The stalled client: a receive buffer of a few KiB, set before connecting
# so that the window stays small, and a long stream it never reads.
stalled = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
stalled.connect((HOST, PORT))
body = json.dumps({"model": MODEL, "prompt": "Count from one to a thousand: one, two,", "max_tokens": MAX_TOKENS,
                   "n": N, "logprobs": LOGPROBS, "temperature": 0.8, "seed": 1, "ignore_eos": True, "stream": True}).encode()
stalled.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}:{PORT}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
started = time.time()
# Read only until the stream has begun (a 200 and its first event), then stop.
head = b""
while b"data: " not in head:
    data = stalled.recv(256)
    assert data, f"closed before the stream began: {head!r}"
    head += data
assert head.startswith(b"HTTP/1.1 200"), head

# While it stalls, others are served: each answers in well under the time
# the stalled stream's buffers take to fill.
for i in range(3):
    t = time.time()
    r = complete(f"Question {i}: what is the capital of France? Answer:", 8)
    assert r["usage"]["completion_tokens"] == 8, r
    print(f"other request {i}: {time.time() - t:.2f} s", flush=True)
passed += 1

# The stalled request is aborted for its reader, not run to max_tokens.
deadline = time.time() + 300
while True:
    m = metrics()
    if m.get("vellum:requests_aborted_slow_reader_total", 0) >= 1:
        break
    assert time.time() < deadline, f"the stalled request was not aborted within 300 s: {m}"
    time.sleep(0.5)
aborted_after = time.time() - started
generated = m.get("vllm:generation_tokens_total", 0) - 3 * 8
print(f"stalled request aborted after {aborted_after:.1f} s and {generated:.0f} generated tokens", flush=True)
assert generated < N * MAX_TOKENS, f"the stalled request ran to the end ({generated} tokens)"
passed += 1

# Nothing runs, nothing waits, no KV block is held, with the socket still open.
for _ in range(60):
    m = metrics()
    if m.get("vllm:num_requests_running") == 0 and m.get("vllm:kv_cache_usage_perc") == 0:
        break
    time.sleep(0.5)
assert m.get("vllm:num_requests_running") == 0 and m.get("vllm:num_requests_waiting") == 0, m
assert m.get("vllm:kv_cache_usage_perc") == 0, m
assert complete("After the stall:", 4)["usage"]["completion_tokens"] == 4
passed += 1

# Reading the socket now: the chunks buffered so far, then an error event.
stalled.settimeout(60)
received = head
while True:
    data = stalled.recv(1 << 16)
    if not data:
        break
    received += data
stalled.close()
text = received.decode(errors="replace")
events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
assert text.startswith("HTTP/1.1 200"), text[:200]
assert len(events) > 10, f"{len(events)} events"
assert any('"error"' in e and "read" in e for e in events[-3:]), events[-3:]
print(f"the stalled socket held {len(received)} bytes, {len(events)} events; last: {events[-1][:160]}", flush=True)
passed += 1

print(f"{passed} passed, 0 failed")
