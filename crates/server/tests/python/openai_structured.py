"""Structured outputs through the official `openai` client against `vellum serve`.

Usage: python3 openai_structured.py BASE_URL

50 requests with varied JSON schemas (nested objects, arrays, enums, bounded
numbers, required fields) must each come back as JSON that validates against
its schema (checked with the `jsonschema` package); regex, choice and
json_object outputs match; n = 3 samples each obey; a bad schema or two
constraints at once are 400s naming the field.
"""
import json
import random
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai

BASE = sys.argv[1]
client = openai.OpenAI(base_url=BASE + "/v1", api_key="none", max_retries=0, timeout=600)
model = client.models.list().data[0].id
rng = random.Random(7)
passed = 0


def leaf(depth):
    """A random property schema, small enough for a 135M model to finish."""
    # No free-form `number`: a greedy 135M model may write decimals until
    # max_tokens (reported as `length`, as it should be); bounded integers
    # are the bounded numbers here.
    kind = rng.choice(["string", "integer", "boolean", "enum", "array", "object"] if depth < 2 else
                      ["string", "integer", "boolean", "enum"])
    if kind == "string":
        return {"type": "string", "maxLength": rng.choice([8, 12, 16])}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 100)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cat", "dog", "yes", "no", "north", "south"], rng.randint(2, 4))}
    if kind == "array":
        return {"type": "array", "items": leaf(depth + 1), "minItems": 1, "maxItems": rng.randint(1, 3)}
    return obj(depth + 1)


def obj(depth=0):
    names = rng.sample(["name", "age", "city", "color", "count", "ok", "tags", "score", "kind", "owner", "size"],
                       rng.randint(1, 4))
    props = {n: leaf(depth) for n in names}
    required = [n for n in names if rng.random() < 0.8]
    s = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        s["required"] = required
    return s


schemas = [obj() for _ in range(50)]
subjects = ["a person", "a pet", "a city", "a car", "a book", "a planet", "a recipe", "a song", "a team", "a tree"]


def ask(i):
    schema = schemas[i]
    stream = i % 5 == 0
    messages = [{"role": "user", "content": f"Describe {subjects[i % len(subjects)]} as JSON."}]
    rf = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
    if stream:
        text, finish = "", None
        for c in client.chat.completions.create(model=model, messages=messages, response_format=rf, max_tokens=400,
                                                temperature=0, stream=True):
            if c.choices:
                text += c.choices[0].delta.content or ""
                finish = c.choices[0].finish_reason or finish
    else:
        r = client.chat.completions.create(model=model, messages=messages, response_format=rf, max_tokens=400,
                                           temperature=0)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert finish == "stop", f"schema {i}: finish {finish}, text {text!r}"
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return text


with ThreadPoolExecutor(max_workers=10) as pool:
    outputs = list(pool.map(ask, range(len(schemas))))
print(f"50 schemas: every output validates (e.g. {outputs[0]!r})")
passed += 1

# The older vLLM fields and the structured_outputs object, on completions.
r = client.completions.create(model=model, prompt="The year the war ended was", max_tokens=12, temperature=0,
                              extra_body={"structured_outputs": {"regex": r" (19|20)[0-9]{2}\."}})
assert re.fullmatch(r" (19|20)[0-9]{2}\.", r.choices[0].text) and r.choices[0].finish_reason == "stop", r.choices[0]
r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Is water wet?"}], max_tokens=8,
                                   temperature=0, extra_body={"guided_choice": ["yes", "no", "it depends"]})
assert r.choices[0].message.content in ("yes", "no", "it depends"), r.choices[0].message.content
# A prompt the exact (float32) path and the int8 path both close: a 135M model's
# greedy JSON can also run on until max_tokens inside a string, which the
# grammar allows ('Reply with {"ok": true} only.' does so in float32).
r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": 'Return a JSON object with the key "ok" set to true.'}],
                                   max_tokens=300, temperature=0, response_format={"type": "json_object"})
assert r.choices[0].finish_reason == "stop", r.choices[0]
assert isinstance(json.loads(r.choices[0].message.content), dict), r.choices[0].message.content
# Cut by max_tokens mid-object: reported as length, never as a complete answer.
r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Describe a dog as JSON."}],
                                   max_tokens=3, temperature=0, response_format={"type": "json_object"})
assert r.choices[0].finish_reason == "length", r.choices[0]
r = client.completions.create(model=model, prompt="Answer:", max_tokens=40, temperature=0,
                              extra_body={"guided_json": {"type": "object", "properties": {"answer": {"enum": ["A", "B", "C"]}},
                                                          "required": ["answer"]}})
assert json.loads(r.choices[0].text)["answer"] in "ABC", r.choices[0].text
r = client.completions.create(model=model, prompt="A greeting:", max_tokens=20, temperature=0,
                              extra_body={"guided_grammar": 'start: "hello" | "hi" " there"'})
assert r.choices[0].text in ("hello", "hi there"), r.choices[0].text
passed += 1

# Parallel samples each carry their own grammar state.
r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Pick a color."}], n=3,
                                   temperature=1.0, seed=3, max_tokens=8,
                                   extra_body={"guided_choice": ["red", "green", "blue", "dark purple"]})
assert len(r.choices) == 3 and all(c.message.content in ("red", "green", "blue", "dark purple") for c in r.choices), \
    [c.message.content for c in r.choices]
passed += 1

# Bad constraints are 400s naming the field, before any compute.
for extra, field in [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}},
     "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided"),
    ({"response_format": {"type": "xml"}}, "response_format"),
]:
    try:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       extra_body=extra)
        raise AssertionError(f"{extra} must be refused")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and field in str(e), (extra, str(e))
passed += 1

print(f"structured outputs: {passed} checks passed")
