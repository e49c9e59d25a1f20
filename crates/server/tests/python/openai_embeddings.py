"""`/v1/embeddings` through the official `openai` client against `vellum serve
--task embed` (mean pooling, normalized) on the tiny checkpoint that
`tests/serve_embeddings.rs` wrote, whose float64 vectors it computed.

Usage: python3 openai_embeddings.py BASE_URL EXPECTED_JSON

- Token-id inputs, one request for all of them: each vector within 1e-4 of
  the float64 reference (unit vectors, so the gap is an absolute one), unit
  length, `usage.prompt_tokens` the inputs' lengths.
- One by one = batched; the same input twice has cosine 1.0.
- `encoding_format="base64"` decodes to the float vectors.
- A text input gives the vector of its tokens (as `/tokenize` gives them).
- `dimensions` (the checkpoint declares Matryoshka sizes): the first entries,
  renormalized; too many dimensions is a 400 naming the field.
- Errors: an empty input, an out-of-vocabulary id, an unknown field, a bad
  `encoding_format`, an input longer than the context: 400s naming the field.
"""
import base64
import json
import math
import struct
import sys
import urllib.request

import openai

BASE, EXPECTED = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="none")
MODEL = "tiny-embed"
expected = json.load(open(EXPECTED))
prompts, reference = expected["prompts"], expected["embeddings"]
checks = 0


def check(cond, what):
    global checks
    if not cond:
        raise AssertionError(what)
    checks += 1


def gap(a, b):
    return max(abs(x - y) for x, y in zip(a, b))


def norm(v):
    return math.sqrt(sum(x * x for x in v))


# Token-id inputs, all in one request, against the float64 reference.
r = client.embeddings.create(model=MODEL, input=prompts)
check(r.object == "list" and r.model == MODEL and len(r.data) == len(prompts), f"shape: {r}")
check([d.index for d in r.data] == list(range(len(prompts))), "indices in input order")
for d, ref in zip(r.data, reference):
    check(len(d.embedding) == len(ref), f"width {len(d.embedding)} vs {len(ref)}")
    g = gap(d.embedding, ref)
    print(f"input {d.index}: {len(prompts[d.index])} tokens, largest gap to float64 {g:.2e}")
    check(g < 1e-4, f"input {d.index}: largest gap to the float64 reference {g}")
    check(abs(norm(d.embedding) - 1.0) < 1e-5, "unit length")
check(r.usage.prompt_tokens == sum(len(p) for p in prompts) == r.usage.total_tokens, f"usage {r.usage}")
batched = [d.embedding for d in r.data]

# One by one = batched; the same input twice: cosine 1.
for p, b in zip(prompts, batched):
    one = client.embeddings.create(model=MODEL, input=[p]).data[0].embedding
    check(gap(one, b) < 1e-6, "one by one = batched")
twice = client.embeddings.create(model=MODEL, input=[prompts[0], prompts[0]]).data
cos = sum(x * y for x, y in zip(twice[0].embedding, twice[1].embedding))
check(abs(cos - 1.0) < 1e-6, f"cosine of identical inputs {cos}")

# base64: little-endian float32 bytes. The client decodes it when it asked
# for floats itself, so ask over raw HTTP to see the encoding.
req = urllib.request.Request(
    f"{BASE}/v1/embeddings",
    data=json.dumps({"model": MODEL, "input": prompts[0], "encoding_format": "base64"}).encode(),
    headers={"Content-Type": "application/json"},
)
raw = json.load(urllib.request.urlopen(req))["data"][0]["embedding"]
check(isinstance(raw, str), "base64 is a string")
blob = base64.b64decode(raw)
decoded = list(struct.unpack(f"<{len(blob) // 4}f", blob))
check(decoded == batched[0], "base64 decodes to the float vector")
# Asked for base64 itself, the client hands the string through.
via_client = client.embeddings.create(model=MODEL, input=prompts[0], encoding_format="base64").data[0].embedding
check(via_client == raw, "the client's base64 string")
# Without encoding_format the client asks for base64 and decodes it; with
# "float" the server sends numbers: the two agree exactly.
floats = client.embeddings.create(model=MODEL, input=prompts[0], encoding_format="float").data[0].embedding
check(floats == batched[0], "encoding_format float = the client's default (base64, decoded)")

# A text input is its tokens.
text = "The quick brown fox"
tok = json.load(
    urllib.request.urlopen(
        urllib.request.Request(
            f"{BASE}/tokenize", data=json.dumps({"prompt": text}).encode(), headers={"Content-Type": "application/json"}
        )
    )
)["tokens"]
by_text = client.embeddings.create(model=MODEL, input=text).data[0].embedding
by_ids = client.embeddings.create(model=MODEL, input=tok).data[0].embedding
check(gap(by_text, by_ids) < 1e-6, "text = its token ids")

# Matryoshka truncation: the first entries, renormalized.
short = client.embeddings.create(model=MODEL, input=[prompts[1]], dimensions=16).data[0].embedding
check(len(short) == 16 and abs(norm(short) - 1.0) < 1e-5, f"dimensions=16: {len(short)} entries")
head = batched[1][:16]
check(gap(short, [x / norm(head) for x in head]) < 1e-5, "truncate, then normalize")


def bad(what, param, **kwargs):
    try:
        client.embeddings.create(model=MODEL, **kwargs)
    except openai.BadRequestError as e:
        body = e.body if isinstance(e.body, dict) else {}
        got = body.get("param") or (body.get("error") or {}).get("param")
        check(e.status_code == 400, f"{what}: status {e.status_code}")
        check(got == param or param in str(e), f"{what}: names {param}: {e}")
        return
    raise AssertionError(f"{what}: accepted")


bad("too many dimensions", "dimensions", input="x", dimensions=65)
bad("an empty input", "input", input="")
bad("an empty list", "input", input=[])
bad("an id outside the vocabulary", "input", input=[[1, 2, 100000]])
bad("an unknown field", "bogus", input="x", extra_body={"bogus": 1})
bad("a bad encoding", "encoding_format", input="x", extra_body={"encoding_format": "int8"})
bad("longer than the context", "input", input=[[65] * 300])

print(f"openai_embeddings.py: {checks} checks passed")
