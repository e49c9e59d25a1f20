"""Drives a running `vellum serve` with the official `openai` package.

Usage: python3 openai_client.py BASE_URL API_KEY MODEL MAX_MODEL_LEN

Each check asserts behaviour a real client relies on; the script ends with
'N passed, M failed' and exits non-zero on any failure.
"""
import json
import sys
import traceback
import urllib.error
import urllib.request

import openai

BASE, KEY, MODEL, MAX_LEN = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
client = openai.OpenAI(base_url=BASE + "/v1", api_key=KEY, max_retries=0, timeout=120)
PROMPT = "The capital of France is"
CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def raw(method, path, body=None, headers=None):
    """Plain HTTP (for what the openai client cannot send)."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    req = urllib.request.Request(BASE + path, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def greedy(prompt=PROMPT, **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    return client.completions.create(model=MODEL, prompt=prompt, **kw)


@check
def models_lists_the_served_name():
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL], ids


@check
def completion_greedy_is_deterministic_with_usage():
    a, b = greedy(), greedy()
    assert a.choices[0].text and a.choices[0].text == b.choices[0].text, (a, b)
    assert a.choices[0].finish_reason == "length", a
    assert a.usage.completion_tokens == 8 and a.usage.prompt_tokens > 0, a.usage
    assert a.usage.total_tokens == a.usage.prompt_tokens + 8
    assert a.object == "text_completion" and a.id.startswith("cmpl-")


@check
def completion_stream_matches_non_stream_and_reports_usage():
    full = greedy().choices[0].text
    chunks = list(greedy(stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full, (text, full)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"], finishes
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8, chunks[-1]
    assert len([c for c in chunks if c.choices]) >= 2, "streamed in more than one chunk"


@check
def token_id_prompt_and_echo():
    ids = json.loads(raw("POST", "/tokenize", {"prompt": PROMPT})[1])["tokens"]
    a = greedy(prompt=ids)
    assert a.choices[0].text == greedy().choices[0].text
    e = greedy(echo=True)
    assert e.choices[0].text.startswith(PROMPT), e.choices[0].text


@check
def chat_and_chat_stream_agree():
    msgs = [{"role": "user", "content": "Say hello."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=12)
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content, r
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.object == "chat.completion"
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=12,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content, (text, msg.content)
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    # max_completion_tokens is honoured like max_tokens.
    r2 = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_completion_tokens=3)
    assert r2.usage.completion_tokens <= 3 and r2.choices[0].finish_reason in ("stop", "length")


@check
def n_samples():
    r = client.completions.create(model=MODEL, prompt=PROMPT, n=3, max_tokens=6, temperature=1.0, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2], r
    assert r.usage.completion_tokens == 18, r.usage
    assert len({c.text for c in r.choices}) >= 2, "three samples at temperature 1 should not all agree"
    seen, done = {}, set()
    for c in client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=5, temperature=1.0, seed=3, stream=True):
        for ch in c.choices:
            seen[ch.index] = seen.get(ch.index, "") + ch.text
            if ch.finish_reason:
                done.add(ch.index)
    assert done == {0, 1} and all(seen.values()), (seen, done)


@check
def completion_logprobs():
    r = greedy(logprobs=3, max_tokens=5)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 5 and len(lp.token_logprobs) == 5 and len(lp.top_logprobs) == 5, lp
    assert "".join(lp.tokens) == r.choices[0].text, (lp.tokens, r.choices[0].text)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 3, (chosen, top)
        assert abs(max(top.values()) - chosen) < 1e-3, "greedy picks the most likely token"
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


@check
def chat_logprobs():
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                       max_tokens=4, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens, content
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content), content


@check
def stop_strings_cut_the_text():
    full = greedy(max_tokens=16).choices[0].text
    words = full.split()
    assert len(words) >= 3, full
    stop = " " + words[2]
    r = greedy(max_tokens=16, stop=[stop])
    assert r.choices[0].finish_reason == "stop", r
    assert r.choices[0].text == full[: full.index(stop)], (r.choices[0].text, full, stop)
    text = "".join(c.choices[0].text for c in greedy(max_tokens=16, stop=stop, stream=True) if c.choices)
    assert text == r.choices[0].text


@check
def unknown_fields_are_ignored():
    r = greedy(extra_body={"definitely_not_a_field": [1, 2], "top_k": 5, "repetition_penalty": 1.1, "ignore_eos": True,
                           "min_tokens": 2, "priority": 0, "return_tokens_as_token_ids": True}, logprobs=1, user="u")
    assert r.choices[0].logprobs.tokens[0].startswith("token_id:"), r.choices[0].logprobs.tokens


@check
def too_long_is_400_with_counts():
    try:
        greedy(max_tokens=MAX_LEN + 10)
    except openai.BadRequestError as e:
        assert e.status_code == 400
        body = e.body
        assert f"maximum context length is {MAX_LEN} tokens" in body["message"], body
        assert f"{MAX_LEN + 10} in the completion" in body["message"], body
        assert body["type"] == "BadRequestError" and body["code"] == 400 and body["param"] == "max_tokens", body
    else:
        raise AssertionError("expected 400")
    try:
        client.completions.create(model=MODEL, prompt="hi " * (MAX_LEN + 5), max_tokens=4)
    except openai.BadRequestError as e:
        assert "input tokens" in e.body["message"], e.body
    else:
        raise AssertionError("expected 400 for an over-long prompt")


@check
def invalid_parameters_are_400_naming_the_param():
    for kw, param in [({"temperature": -1}, "temperature"), ({"top_p": 2}, "top_p"), ({"n": 0}, "n"),
                      ({"logprobs": 50}, "logprobs"), ({"presence_penalty": 5}, "presence_penalty"),
                      ({"extra_body": {"logit_bias": {"999999999": 1}}}, "logit_bias"),
                      # Wrong types name their field too.
                      ({"temperature": "hot"}, "temperature"), ({"max_tokens": "many"}, "max_tokens"),
                      ({"extra_body": {"top_k": [1]}}, "top_k")]:
        try:
            greedy(**kw)
        except openai.BadRequestError as e:
            assert e.body["param"] == param, (kw, e.body)
        else:
            raise AssertionError(f"expected 400 for {kw}")
    try:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    except openai.BadRequestError:
        pass
    else:
        raise AssertionError("expected 400 for empty messages")


@check
def unknown_model_is_404():
    try:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    except openai.NotFoundError as e:
        assert e.status_code == 404 and e.body["type"] == "NotFoundError", e.body
    else:
        raise AssertionError("expected 404")


@check
def api_key_is_required_on_v1_only():
    bad = openai.OpenAI(base_url=BASE + "/v1", api_key="wrong-" + KEY, max_retries=0)
    for c in (bad,):
        try:
            c.models.list()
        except openai.AuthenticationError as e:
            assert e.status_code == 401
        else:
            raise AssertionError("expected 401 with a wrong key")
    status, _ = raw("POST", "/v1/completions", {"prompt": "x"}, {"Content-Type": "application/json"})
    assert status == 401, status
    # The key also works as `x-api-key` (and a wrong one there is refused).
    assert raw("GET", "/v1/models", None, {"x-api-key": KEY})[0] == 200
    assert raw("GET", "/v1/models", None, {"x-api-key": "wrong-" + KEY})[0] == 401
    assert raw("GET", "/health")[0] == 200
    assert raw("GET", "/version")[0] == 200
    assert b"vllm:num_requests_running" in raw("GET", "/metrics")[1]


@check
def malformed_json_is_400_not_500():
    auth = {"Authorization": "Bearer " + KEY, "Content-Type": "application/json"}
    for body in (b"{\"prompt\": ", b"not json", b"", b"[1,2]", b"{\"prompt\": \"x\", \"max_tokens\": \"many\"}"):
        status, out = raw("POST", "/v1/completions", body, auth)
        assert status == 400, (body, status, out)
        err = json.loads(out)["error"]
        assert err["type"] == "BadRequestError" and err["code"] == 400, err
    status, out = raw("POST", "/v1/chat/completions", b"{\"messages\": 3}", auth)
    assert status == 400, (status, out)


@check
def tokenize_detokenize_round_trip():
    status, out = raw("POST", "/tokenize", {"prompt": "Hello world"})
    tok = json.loads(out)
    assert status == 200 and tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == MAX_LEN, tok
    status, out = raw("POST", "/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and json.loads(out)["prompt"].endswith("Hello world"), out
    status, out = raw("POST", "/detokenize", {"tokens": [10 ** 9]})
    assert status == 400, out


passed = failed = 0
for fn in CHECKS:
    try:
        fn()
        passed += 1
        print(f"ok   {fn.__name__}", flush=True)
    except Exception:
        failed += 1
        print(f"FAIL {fn.__name__}", flush=True)
        traceback.print_exc()
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
