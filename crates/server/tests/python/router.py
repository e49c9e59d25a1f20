"""`sglang-router` in front of `vellum serve` replicas, through the official
`openai` client. Run by `tests/router.rs` in three phases:

Usage: python3 router.py route    ROUTER MODEL REPLICA_A REPLICA_B
       python3 router.py failover ROUTER MODEL REPLICA_A REPLICA_B DEAD_URL
       python3 router.py rejoin   ROUTER MODEL REPLICA_A REPLICA_B NEW_URL

- route: the router lists both replicas healthy under the served model name
  (from their /server_info); chat requests answer through it; eight requests
  sharing a long system prompt all land on one replica (cache-aware policy:
  that replica's completed requests grow by eight, and its prefix cache hits).
- failover (one replica killed): the router reports the dead one unhealthy
  within 15 s; until then a request routed to it fails with a 5xx naming the
  connection, any other answers; after it, every request answers (on the
  live replica, whatever its prefix).
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
    # Until the health checks mark the dead replica, a request the
    # cache-aware policy sends there fails with the router's 5xx naming the
    # connection (it is not retried: SGLang's router retries answers, not
    # refused connections); every other request answers.
    deadline, sent, failed = time.time() + 15, 0, 0
    while workers()[extra]["is_healthy"] is not False:
        check(time.time() < deadline, f"the dead replica reported unhealthy within 15 s: {workers()}")
        sent += 1
        try:
            ask(f"Question {sent} while a replica is dead: where can I park?")
        except openai.InternalServerError as e:
            failed += 1
            check("error sending request" in str(e) and extra.split("//")[1] in str(e), f"a clear error: {e}")
        time.sleep(0.2)
    print(f"before the router marked the dead replica: {sent} requests, {failed} failed with a connection error")
    check(workers()[A]["is_healthy"], "the live replica stays healthy")
    for i in range(8):
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
