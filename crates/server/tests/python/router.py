"""`sglang-router` in front of `vellum serve` replicas, through the official
`openai` client. Run by `tests/router.rs` in three phases:

Usage: python3 router.py route    ROUTER MODEL REPLICA_A REPLICA_B
       python3 router.py failover ROUTER MODEL REPLICA_A REPLICA_B PID_A PID_B
       python3 router.py rejoin   ROUTER MODEL REPLICA_A REPLICA_B NEW_URL

- route: the router lists both replicas healthy under the served model name
  (from their /server_info); chat requests answer through it; eight requests
  sharing a long system prompt all land on one replica (cache-aware policy:
  that replica's completed requests grow by eight, and its prefix cache hits).
- failover: the replica holding the shared prefix is killed while four
  clients have requests in flight to it; the router retries every
  non-streamed one on the live replica (none is lost), a stream cut mid-answer
  ends with a connection error, the router reports the dead replica unhealthy
  within 15 s, and every later request answers.
- rejoin: a restarted replica, added through the router's worker API, is
  listed healthy within 30 s, and requests answer.
"""
import json
import sys
import time
import urllib.request

import openai

phase, ROUTER, MODEL, A, B = sys.argv[1:6]
extra = sys.argv[6] if len(sys.argv) > 6 else None
client = openai.OpenAI(base_url=ROUTER + "/v1", api_key="none", max_retries=0, timeout=120)
checks = 0


def check(cond, what):
    global checks
    if not cond:
        raise AssertionError(what)
    checks += 1


def get(url):
    return json.load(urllib.request.urlopen(url, timeout=10))


def workers():
    return {w["url"]: w for w in get(ROUTER + "/workers")["workers"]}


def wait_for(cond, seconds, what):
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            if cond():
                return
        except Exception:  # noqa: BLE001 (the router may not answer yet)
            pass
        time.sleep(0.5)
    raise AssertionError(f"{what} within {seconds} s: {get(ROUTER + '/workers')}")


def metric(url, name):
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(name))


SYSTEM = "You are the front desk of a small hotel by the sea. " + " ".join(
    f"Rule {i}: answer questions about rooms, breakfast and parking politely and briefly." for i in range(20)
)


def ask(question, system=SYSTEM):
    r = client.chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
    )
    check(r.choices[0].message.content is not None and r.usage.completion_tokens > 0, f"an answer: {r}")


if phase == "route":
    wait_for(lambda: all(workers().get(u, {}).get("is_healthy") for u in (A, B)), 60, "both replicas registered healthy")
    check(all(w["model_id"] == MODEL for w in workers().values()), f"the served name is the model id: {workers()}")
    done = {u: metric(u, "vllm:request_success_total") for u in (A, B)}
    hits = {u: metric(u, "vllm:prefix_cache_hits_total") for u in (A, B)}
    for i in range(8):
        ask(f"Question {i}: is breakfast included?")
    grew = {u: metric(u, "vllm:request_success_total") - done[u] for u in (A, B)}
    check(sorted(grew.values()) == [0, 8], f"the shared prefix went to one replica: {grew}")
    home = max(grew, key=grew.get)
    check(metric(home, "vllm:prefix_cache_hits_total") > hits[home], "and hit its prefix cache")
    ask("Another system prompt, another question.", system="You are a terse assistant.")
elif phase == "failover":
    # Mid-run: four clients keep the replica holding the shared prefix busy
    # (non-streamed requests, and two streams), and this script kills it
    # (SIGKILL) with requests in flight. The router retries a failed
    # non-streamed request (here for ~5 s, longer than its health checks
    # take to mark the replica), so every one answers, on the live replica;
    # a stream already answering from the dead replica cannot be replayed:
    # it ends with a connection error, never a hang.
    import os
    import signal
    import threading

    pids = {A: int(sys.argv[6]), B: int(sys.argv[7])}
    home = max((A, B), key=lambda u: metric(u, "vllm:request_success_total"))
    live = B if home == A else A
    lock, stop = threading.Lock(), time.time() + 8
    answered, failed, streams = [0], [], []

    def load(k):
        n = 0
        while time.time() < stop:
            n += 1
            try:
                ask(f"Client {k}, question {n}: where can I park?")
                with lock:
                    answered[0] += 1
            except Exception as e:  # noqa: BLE001 (any failure is a lost request)
                with lock:
                    failed.append(f"{type(e).__name__}: {e}")

    def stream(k):
        short = openai.OpenAI(base_url=ROUTER + "/v1", api_key="none", max_retries=0, timeout=30)
        try:
            chunks = short.chat.completions.create(
                model=MODEL, max_tokens=200, temperature=0, stream=True,
                messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Stream {k}: describe the rooms."}],
            )
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            outcome = f"finished ({finish})" if finish else "ended without a finish reason"
        except Exception as e:  # noqa: BLE001 (whatever ends it is recorded and judged below)
            outcome = f"cut: {type(e).__name__}: {e}"
        with lock:
            streams.append(outcome)

    threads = [threading.Thread(target=load, args=(k,)) for k in range(4)]
    threads += [threading.Thread(target=stream, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    os.kill(pids[home], signal.SIGKILL)
    killed_at = time.time()
    for t in threads:
        t.join(60)
    check(not any(t.is_alive() for t in threads), "every client returned within 60 s (no hang)")
    print(f"killed {home} with requests in flight; {answered[0]} non-streamed requests answered, {len(failed)} failed; streams: {streams}")
    check(answered[0] > 0 and not failed, f"no non-streamed request lost (the router retried those it could): {failed[:3]}")
    check(len(streams) == 2 and all(s.startswith("finished") or s.startswith("cut: APIConnectionError") for s in streams),
          f"each stream finished or was cut with a clear error: {streams}")
    wait_for(lambda: workers()[home]["is_healthy"] is False, max(1, 15 - (time.time() - killed_at)), "the dead replica reported unhealthy")
    check(workers()[live]["is_healthy"], "the live replica stays healthy")
    for i in range(4):
        ask(f"Question {i} after a replica died: where can I park?")
elif phase == "rejoin":
    req = urllib.request.Request(ROUTER + "/workers", data=json.dumps({"url": extra}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    status = urllib.request.urlopen(req, timeout=10).status
    check(200 <= status < 300, f"the worker API took the replica: {status}")
    wait_for(lambda: workers().get(extra, {}).get("is_healthy") is True, 30, "the restarted replica listed healthy")
    for i in range(4):
        ask(f"Question {i} after the restart: when is checkout?")
else:
    raise SystemExit(f"unknown phase {phase}")

print(f"router.py {phase}: {checks} checks passed")
