"""The tool-call and reasoning parsers through the real server and the
official clients.

Usage: python3 openai_parsers.py BASE_URL

The server runs `--reasoning-parser deepseek_r1 --tool-call-parser pythonic`
with a chat template whose generation prompt opens `<think>` (so the output
starts inside reasoning). The small model writes neither format by itself:
`guided_regex` forces known text through the real generation path.

- Forced `…</think>[get_weather(city="Paris", days=3)]` with tools: the
  reasoning is `reasoning_content`, the list is a call with JSON arguments,
  `finish_reason` `tool_calls`; the stream's deltas add up to the same.
- Forced `…</think>Hello there.` without tools: reasoning and content split,
  whole and streamed alike.
- `skip_special_tokens: false`: the EOS that ends the output is not text.
- `usage.completion_tokens_details.reasoning_tokens` (whole and streamed)
  counts the tokens through `</think>`; the Responses API's
  `output_tokens_details.reasoning_tokens` likewise.
- Unconstrained output (no `</think>`): all reasoning; in the Responses API
  a `reasoning` item (whole, through the stream helper and as raw events), in
  the Messages API a `thinking` block (whole and streamed).
- Thinking switched off reaches the template (which then closes `<think>` in
  the prompt, so it has more tokens): chat's `chat_template_kwargs`, `/tokenize`'s,
  Responses' `reasoning.effort: "none"` (other efforts leave it on, and Codex
  CLI's `include: ["reasoning.encrypted_content"]` is accepted), Messages'
  `thinking: {"type": "disabled"}`.
"""
import json
import sys
import urllib.request

import anthropic
import openai

BASE = sys.argv[1]
client = openai.OpenAI(base_url=BASE + "/v1", api_key="none", max_retries=0, timeout=600)
model = client.models.list().data[0].id
passed = 0

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city for some days",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


def check(cond, what):
    global passed
    if not cond:
        raise AssertionError(what)
    passed += 1


def chat(regex, stream, **kw):
    """A greedy chat forced to match `regex`; the stream reassembled."""
    args = dict(model=model, messages=MESSAGES, max_tokens=48, temperature=0, extra_body={"guided_regex": regex, **kw.pop("extra", {})}, **kw)
    if not stream:
        c = client.chat.completions.create(**args).choices[0]
        m = c.message
        reasoning = getattr(m, "reasoning_content", None)
        calls = [(t.function.name, json.loads(t.function.arguments)) for t in (m.tool_calls or [])]
        return reasoning, m.content, calls, c.finish_reason
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            d = c.delta
            reasoning += getattr(d, "reasoning_content", None) or ""
            content += d.content or ""
            for t in d.tool_calls or []:
                name, arguments = calls.get(t.index, ("", ""))
                calls[t.index] = (name + (t.function.name or ""), arguments + (t.function.arguments or ""))
            finish = c.finish_reason or finish
    calls = [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())]
    return reasoning or None, content or None, calls, finish


# Reasoning, then a pythonic call.
REGEX = r'Paris is in France\.</think>\[get_weather\(city="Paris", days=3\)\]'
whole = chat(REGEX, False, tools=TOOLS)
check(whole[0] == "Paris is in France.", f"reasoning_content: {whole}")
check(whole[2] == [("get_weather", {"city": "Paris", "days": 3})], f"the pythonic call: {whole}")
check(not whole[1], f"no content beside the call: {whole}")
check(whole[3] == "tool_calls", f"finish_reason: {whole}")
streamed = chat(REGEX, True, tools=TOOLS)
check(streamed == (whole[0], None, whole[2], whole[3]), f"streamed {streamed} == whole {whole}")

# Reasoning, then an answer (no tools).
REGEX = r"Hmm\.</think>Hello there\."
whole = chat(REGEX, False)
check(whole[:2] == ("Hmm.", "Hello there."), f"reasoning and content: {whole}")
check(chat(REGEX, True)[:2] == whole[:2], "streamed == whole")

# usage counts the reasoning's tokens apart ("Hmm." and "</think>"), whole and streamed.
u = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=48, temperature=0, extra_body={"guided_regex": REGEX}).usage
r_tokens = u.completion_tokens_details.reasoning_tokens
check(0 < r_tokens < u.completion_tokens, f"reasoning tokens among the completion's: {u}")
last = [c for c in client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=48, temperature=0, stream=True,
                                                   stream_options={"include_usage": True}, extra_body={"guided_regex": REGEX}) if c.usage]
check(last and last[-1].usage.completion_tokens_details.reasoning_tokens == r_tokens, f"streamed usage: {last}")

# The EOS after forced text is not text, even with special tokens kept.
kept = chat(REGEX, False, extra={"skip_special_tokens": False})
check(kept[:2] == ("Hmm.", "Hello there.") and kept[3] == "stop", f"no EOS text: {kept}")

# Unconstrained: no `</think>`, so all reasoning.
c = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0).choices[0]
check(getattr(c.message, "reasoning_content", None) and not c.message.content, f"all reasoning: {c.message}")

# The Responses API: a reasoning item, whole and streamed.
r = client.responses.create(model=model, input="What is 2+2?", max_output_tokens=8, temperature=0)
check(r.output and r.output[0].type == "reasoning" and r.output[0].id.startswith("rs_"), f"a reasoning item: {r.output}")
text = r.output[0].content[0].text
check(r.output[0].content[0].type == "reasoning_text" and text, f"reasoning_text: {r.output[0]}")
check(r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens, f"all 8 tokens reasoning: {r.usage}")
with client.responses.stream(model=model, input="What is 2+2?", max_output_tokens=8, temperature=0) as s:
    deltas = [e.delta for e in s if e.type == "response.reasoning_text.delta"]
    final = s.get_final_response()
check("".join(deltas) == text, f"the reasoning_text deltas add up: {deltas!r} vs {text!r}")
check(final.output[0].type == "reasoning" and final.output[0].content[0].text == text, f"the helper's response: {final.output}")

# The Messages API: a thinking block, whole and streamed.
a = anthropic.Anthropic(base_url=BASE, api_key="none", max_retries=0)
m = a.messages.create(model=model, max_tokens=8, extra_body={"temperature": 0}, messages=[{"role": "user", "content": "What is 2+2?"}])
check(m.content and m.content[0].type == "thinking" and m.content[0].thinking == text, f"a thinking block: {m.content}")
with a.messages.stream(model=model, max_tokens=8, extra_body={"temperature": 0}, messages=[{"role": "user", "content": "What is 2+2?"}]) as s:
    streamed = s.get_final_message()
check(streamed.content[0].type == "thinking" and streamed.content[0].thinking == text, f"streamed thinking: {streamed.content}")

# Thinking switched off: the template closes <think> in the prompt.
OFF = {"enable_thinking": False}
on = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1).usage.prompt_tokens
off = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1, extra_body={"chat_template_kwargs": OFF}).usage.prompt_tokens
check(off > on, f"chat_template_kwargs reach the template: {on} vs {off} prompt tokens")


def tokenize(body):
    req = urllib.request.Request(BASE + "/tokenize", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req))["count"]


check(tokenize({"messages": MESSAGES, "chat_template_kwargs": OFF}) == off, "/tokenize renders with them too")
check(tokenize({"messages": MESSAGES}) == on, "/tokenize without them")
r_on = client.responses.create(model=model, input=MESSAGES[0]["content"], max_output_tokens=1,
                               reasoning={"effort": "high", "summary": "auto"}, include=["reasoning.encrypted_content"])
r_off = client.responses.create(model=model, input=MESSAGES[0]["content"], max_output_tokens=1, reasoning={"effort": "none"})
check(r_on.usage.input_tokens == on and r_off.usage.input_tokens == off, f"reasoning.effort: {r_on.usage} / {r_off.usage}")
check(r_on.reasoning.effort == "high" and r_off.reasoning.effort == "none", f"the effort is echoed: {r_on.reasoning}")
m_on = a.messages.create(model=model, max_tokens=16, messages=MESSAGES, thinking={"type": "enabled", "budget_tokens": 1024})
m_off = a.messages.create(model=model, max_tokens=1, messages=MESSAGES, thinking={"type": "disabled"})
check(m_on.usage.input_tokens == on and m_off.usage.input_tokens == off, f"thinking: {m_on.usage} / {m_off.usage}")

print(f"parsers: {passed} checks passed")
