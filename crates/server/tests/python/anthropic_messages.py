"""Anthropic's Messages API through the official `anthropic` client against
`vellum serve`.

Usage: python3 anthropic_messages.py BASE_URL API_KEY

- A message: text content, `end_turn` or `max_tokens`, usage counted; the
  same text streamed (the client's own event accumulation) as whole, greedy.
- `stop_sequences`: a word of that answer ends it just before, with
  `stop_reason` `stop_sequence` naming it, whole and streamed.
- `system` as a string and as text blocks give the same answer.
- `tool_choice` `any` and a named tool: a `tool_use` block whose `input` is
  an object with the tool's required keys, `stop_reason` `tool_use`, whole and
  streamed (`input_json_delta` fragments reassembled by the client); a
  conversation with the `tool_result` renders and answers.
- `count_tokens` counts the rendered prompt: the message's `input_tokens`.
- Errors in Anthropic's shape: a wrong key is 401 `authentication_error`; a
  missing `max_tokens`, a `thinking` of no known type, an image block and an
  unknown field are 400 `invalid_request_error` naming what is wrong.
"""
import json
import sys
import urllib.error
import urllib.request

import anthropic

BASE, KEY = sys.argv[1], sys.argv[2]
client = anthropic.Anthropic(base_url=BASE, api_key=KEY, max_retries=0, timeout=600)
MODEL = "vellum"
# The client no longer takes sampling parameters as arguments; the API does.
GREEDY = {"temperature": 0}
passed = 0


def check(cond, what):
    global passed
    assert cond, what
    passed += 1


ask = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]

# A whole message, then the same one streamed.
m = client.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=ask)
check(m.type == "message" and m.role == "assistant" and m.id.startswith("msg_"), f"message envelope: {m}")
check(len(m.content) == 1 and m.content[0].type == "text" and m.content[0].text.strip(), f"one text block: {m.content}")
check(m.stop_reason in ("end_turn", "max_tokens"), f"stop_reason {m.stop_reason}")
check(m.usage.input_tokens > 5 and 0 < m.usage.output_tokens <= 24, f"usage {m.usage}")
with client.messages.stream(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=ask) as s:
    events = [e.type for e in s]
    streamed = s.get_final_message()
check(events[0] == "message_start" and "content_block_delta" in events and events[-1] == "message_stop", f"events {events}")
check(streamed.content[0].text == m.content[0].text, f"streamed {streamed.content} vs whole {m.content}")
check(streamed.stop_reason == m.stop_reason and streamed.usage.output_tokens == m.usage.output_tokens, f"{streamed} vs {m}")

short = client.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY, messages=ask)
check(short.stop_reason == "max_tokens" and short.usage.output_tokens == 2, f"cut at max_tokens: {short}")

# A stop sequence taken from the greedy answer ends it there, named.
words = [w.strip(".,!?") for w in m.content[0].text.split()]
word = next((w for w in reversed(words) if len(w) >= 3), None)
check(word is not None, f"a word to stop on in {m.content[0].text!r}")
cut = client.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=ask, stop_sequences=[word, "never-appears"])
check(cut.stop_reason == "stop_sequence" and cut.stop_sequence == word, f"stopped on {word!r}: {cut}")
check(cut.content[0].text == m.content[0].text[:m.content[0].text.index(word)] if m.content[0].text.index(word) > 0 else not cut.content,
      f"cut before {word!r}: {cut.content} vs {m.content}")
with client.messages.stream(model=MODEL, max_tokens=24, extra_body=GREEDY, messages=ask, stop_sequences=[word]) as s:
    cut_streamed = s.get_final_message()
check(cut_streamed.stop_reason == "stop_sequence" and cut_streamed.stop_sequence == word, f"streamed stop: {cut_streamed}")

a = client.messages.create(model=MODEL, max_tokens=16, extra_body=GREEDY, system="You are terse.", messages=ask)
b = client.messages.create(model=MODEL, max_tokens=16, extra_body=GREEDY, system=[{"type": "text", "text": "You are terse."}], messages=ask)
check(a.content[0].text == b.content[0].text, "system as a string and as blocks")

# Tools.
TOOLS = [{
    "name": "get_weather", "description": "Current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"],
                     "additionalProperties": False},
}]
weather = [{"role": "user", "content": "What is the weather in Paris?"}]
for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
    t = client.messages.create(model=MODEL, max_tokens=128, extra_body=GREEDY, tools=TOOLS, tool_choice=choice, messages=weather)
    uses = [c for c in t.content if c.type == "tool_use"]
    check(t.stop_reason == "tool_use" and uses, f"{choice}: a tool_use block: {t}")
    check(uses[0].name == "get_weather" and isinstance(uses[0].input, dict) and "city" in uses[0].input, f"{choice}: input {uses[0]}")
    with client.messages.stream(model=MODEL, max_tokens=128, extra_body=GREEDY, tools=TOOLS, tool_choice=choice, messages=weather) as s:
        st = s.get_final_message()
    st_uses = [c for c in st.content if c.type == "tool_use"]
    check(st.stop_reason == "tool_use" and [u.input for u in st_uses] == [u.input for u in uses], f"{choice}: streamed {st} vs {t}")

followup = weather + [
    {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id, "name": "get_weather", "input": uses[0].input}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "18 degrees and sunny"}]},
]
f = client.messages.create(model=MODEL, max_tokens=32, extra_body=GREEDY, tools=TOOLS, messages=followup)
check(f.usage.input_tokens > t.usage.input_tokens and f.content, f"the tool result renders: {f}")

# count_tokens is the prompt the message counted.
n = client.messages.count_tokens(model=MODEL, messages=ask)
check(n.input_tokens == m.usage.input_tokens, f"count_tokens {n.input_tokens} vs usage {m.usage.input_tokens}")
n_tools = client.messages.count_tokens(model=MODEL, messages=weather, tools=TOOLS)
check(n_tools.input_tokens > client.messages.count_tokens(model=MODEL, messages=weather).input_tokens, "tools count")

# Errors in Anthropic's shape.
try:
    anthropic.Anthropic(base_url=BASE, api_key="wrong", max_retries=0).messages.create(model=MODEL, max_tokens=4, messages=ask)
    check(False, "a wrong key is refused")
except anthropic.AuthenticationError as e:
    check(e.status_code == 401, f"401: {e}")


def post(body):
    req = urllib.request.Request(BASE + "/v1/messages", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json", "x-api-key": KEY})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


for body, needle in [
    ({"model": MODEL, "messages": ask}, "max_tokens"),
    ({"model": MODEL, "max_tokens": 8, "messages": ask, "thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
]:
    status, err = post(body)
    check(status == 400 and err.get("type") == "error" and err["error"]["type"] == "invalid_request_error", f"{needle}: {status} {err}")
    check(needle in err["error"]["message"], f"the error names {needle}: {err}")

print(f"anthropic_messages.py: {passed} checks passed")
