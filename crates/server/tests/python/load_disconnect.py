"""Load and disconnect test for a running `vellum serve`.

Usage: python3 load_disconnect.py HOST PORT API_KEY MODEL

64 concurrent streaming clients on loopback; every fifth hangs up after a
few chunks (socket reset mid-stream). Afterwards: every KV block is free,
nothing runs or waits, the server still answers, and the metrics add up
(successes + aborts = clients, aborts = hang-ups). Then one non-streaming
client hangs up before its answer: its request is aborted too.
Ends with 'N passed, M failed'.
"""
import asyncio
import json
import re
import sys
import time

HOST, PORT, KEY, MODEL = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
CLIENTS, MAX_TOKENS, HANG_AFTER = 64, 24, 3


async def request(method, path, body=None):
    """One HTTP/1.1 exchange; returns (status, headers, reader, writer)."""
    reader, writer = await asyncio.open_connection(HOST, PORT)
    data = json.dumps(body).encode() if body is not None else b""
    head = (f"{method} {path} HTTP/1.1\r\nHost: {HOST}:{PORT}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n")
    writer.write(head.encode() + data)
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    headers = {}
    while True:
        line = (await reader.readline()).decode().strip()
        if not line:
            break
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers, reader, writer


async def body_chunks(reader, headers):
    if headers.get("transfer-encoding") == "chunked":
        while True:
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                return
            chunk = await reader.readexactly(size + 2)
            yield chunk[:-2]
    else:
        yield await reader.read()


async def get_text(path):
    status, headers, reader, writer = await request("GET", path)
    out = b"".join([c async for c in body_chunks(reader, headers)])
    writer.close()
    return status, out.decode()


async def metrics():
    _, text = await get_text("/metrics")
    values = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.match(r"^([^{ ]+)(\{[^}]*\})? (\S+)$", line)
        if m:
            name, labels = m.group(1), m.group(2) or ""
            reason = re.search(r'finished_reason="(\w+)"', labels)
            key = f"{name}:{reason.group(1)}" if reason else name
            if 'le="' not in labels:
                values[key] = float(m.group(3))
    return values


async def stream_client(i, hang):
    body = {"model": MODEL, "prompt": f"Story number {i}: once upon a time", "max_tokens": MAX_TOKENS,
            "temperature": 0.8, "seed": i, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    status, headers, reader, writer = await request("POST", "/v1/completions", body)
    assert status == 200, status
    buf, chunks, finish, done, tokens = b"", 0, None, False, None
    async for data in body_chunks(reader, headers):
        buf += data
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            payload = event.decode().removeprefix("data: ").strip()
            if payload == "[DONE]":
                done = True
                continue
            v = json.loads(payload)
            assert "error" not in v, v
            if v.get("usage"):
                tokens = v["usage"]["completion_tokens"]
            for c in v["choices"]:
                if c["text"]:
                    chunks += 1
                finish = c["finish_reason"] or finish
        if hang and chunks >= HANG_AFTER:
            writer.transport.abort()  # reset, mid-stream
            return ("hung", chunks)
    writer.close()
    return ("done", tokens, finish, done)


async def wait_idle(timeout=30.0):
    end = time.monotonic() + timeout
    while True:
        m = await metrics()
        if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0:
            return m
        if time.monotonic() > end:
            raise AssertionError(f"still busy after {timeout}s: {m}")
        await asyncio.sleep(0.1)


async def main():
    results = []

    def check(name, cond, detail=""):
        results.append(bool(cond))
        print(("ok   " if cond else "FAIL ") + name + ("" if cond else f": {detail}"), flush=True)

    before = await metrics()
    hangers = {i for i in range(CLIENTS) if i % 5 == 4}
    t0 = time.monotonic()
    outs = await asyncio.wait_for(asyncio.gather(*(stream_client(i, i in hangers) for i in range(CLIENTS))), 300)
    elapsed = time.monotonic() - t0
    print(f"{CLIENTS} clients ({len(hangers)} hung up) in {elapsed:.1f}s", flush=True)
    completed = [o for o in outs if o[0] == "done"]
    check("every hanging client hung up mid-stream", sum(o[0] == "hung" for o in outs) == len(hangers))
    check("every other client got all its tokens, a finish reason and [DONE]",
          len(completed) == CLIENTS - len(hangers) and all(o[1] == MAX_TOKENS and o[2] == "length" and o[3] for o in completed),
          [o for o in completed if not (o[1] == MAX_TOKENS and o[2] == "length" and o[3])][:3])
    after = await wait_idle()
    d = lambda k: after.get(k, 0) - before.get(k, 0)
    check("all KV blocks free (usage 0)", after["vllm:kv_cache_usage_perc"] == 0 and after["vellum:kv_cache_used_blocks"] == 0, after)
    check("successes add up", d("vllm:request_success_total:length") + d("vllm:request_success_total:stop") == len(completed),
          (d("vllm:request_success_total:length"), d("vllm:request_success_total:stop")))
    check("aborts add up", d("vllm:request_success_total:abort") == len(hangers), d("vllm:request_success_total:abort"))
    check("engine counted the disconnects", d("vellum:requests_aborted_by_disconnect_total") == len(hangers),
          d("vellum:requests_aborted_by_disconnect_total"))
    check("generation tokens add up", d("vllm:generation_tokens_total") >= len(completed) * MAX_TOKENS,
          d("vllm:generation_tokens_total"))
    check("e2e histogram counts the finished requests", d("vllm:e2e_request_latency_seconds_count") == len(completed),
          d("vllm:e2e_request_latency_seconds_count"))
    check("TTFT histogram counts every request", d("vllm:time_to_first_token_seconds_count") == CLIENTS,
          d("vllm:time_to_first_token_seconds_count"))

    # A non-streaming client that hangs up before the answer.
    before = after
    status, headers, reader, writer = None, None, None, None
    reader, writer = await asyncio.open_connection(HOST, PORT)
    data = json.dumps({"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 400, "ignore_eos": True}).encode()
    writer.write((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data)
    await writer.drain()
    await asyncio.sleep(1.0)
    writer.transport.abort()
    t_hang = time.monotonic()
    while True:
        m = await metrics()
        if m["vellum:requests_aborted_by_disconnect_total"] > before["vellum:requests_aborted_by_disconnect_total"]:
            break
        if time.monotonic() - t_hang > 10:
            break
        await asyncio.sleep(0.05)
    check("a non-streaming client that hangs up is aborted", m["vellum:requests_aborted_by_disconnect_total"] == before["vellum:requests_aborted_by_disconnect_total"] + 1,
          m["vellum:requests_aborted_by_disconnect_total"])
    print(f"non-streaming abort seen after {time.monotonic() - t_hang:.2f}s", flush=True)
    m = await wait_idle()
    check("its blocks are free", m["vellum:kv_cache_used_blocks"] == 0, m["vellum:kv_cache_used_blocks"])

    # The server still answers.
    status, headers, reader, writer = await request("POST", "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 4})
    out = json.loads(b"".join([c async for c in body_chunks(reader, headers)]))
    writer.close()
    check("the server still answers", status == 200 and out["usage"]["completion_tokens"] == 4, out)

    passed = sum(results)
    print(f"{passed} passed, {len(results) - passed} failed")
    sys.exit(0 if passed == len(results) else 1)


asyncio.run(main())
