"""OpenAI's Responses API through the official `openai` client against
`vellum serve` (the default model).

Usage: python3 openai_responses.py BASE_URL API_KEY MODEL

- A response: `resp_` id, `completed`, `output_text`, usage counted; the same
  answer streamed through the client's stream helper (which rebuilds the
  response from the typed events and checks their order and identities) and
  as raw events (`sequence_number` counting up from 0, the deltas adding up to
  the text, `response.completed` last).
- `max_output_tokens` cuts the answer: `incomplete` with the reason, whole
  and streamed (`response.incomplete` last).
- Tools: `tool_choice` `required` and a named function give a
  `function_call` item whose arguments hold the tool's required keys, whole
  and streamed alike (greedy); its `function_call_output` sent back through
  `previous_response_id` is answered.
- `previous_response_id` carries the conversation (the second turn's input
  tokens count the first turn's), `instructions` do not carry over.
- `text.format` `json_schema`: the output parses and has the schema's keys.
- Stored responses: `retrieve` gives the same response, `delete` removes it,
  `store=False` keeps none.
- Errors: an unknown field, a hosted tool, a bad `max_output_tokens` are 400s
  naming them; an unknown `previous_response_id` is a 404.
"""
import json
import sys

import openai

BASE, KEY, MODEL = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=BASE + "/v1", api_key=KEY, max_retries=0, timeout=600)
passed = 0


def check(cond, what):
    global passed
    assert cond, what
    passed += 1


ASK = "What is the capital of France? Answer in one word."

# A whole response, then the same one through the stream helper and raw.
r = client.responses.create(model=MODEL, input=ASK, instructions="Be brief.", max_output_tokens=48, temperature=0)
check(r.id.startswith("resp_") and r.object == "response" and r.model == MODEL, f"envelope {r.id} {r.object} {r.model}")
check(r.status == "completed" and r.output_text.strip(), f"completed with text: {r.status} {r.output_text!r}")
check(len(r.output) == 1 and r.output[0].type == "message" and r.output[0].content[0].type == "output_text", f"one message: {r.output}")
check(r.usage.input_tokens > 5 and 0 < r.usage.output_tokens <= 48, f"usage {r.usage}")
check(r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens, f"total {r.usage}")

with client.responses.stream(model=MODEL, input=ASK, instructions="Be brief.", max_output_tokens=48, temperature=0) as s:
    kinds = [e.type for e in s]
    final = s.get_final_response()
check(kinds[0] == "response.created" and kinds[-1] == "response.completed", f"lifecycle {kinds}")
check("response.output_text.delta" in kinds and "response.output_item.done" in kinds, f"events {kinds}")
check(final.output_text == r.output_text and final.status == "completed", f"streamed {final.output_text!r} vs {r.output_text!r}")
check(final.usage.output_tokens == r.usage.output_tokens, f"{final.usage} vs {r.usage}")

raw = list(client.responses.create(model=MODEL, input=ASK, instructions="Be brief.", max_output_tokens=48, temperature=0, stream=True))
check([e.sequence_number for e in raw] == list(range(len(raw))), "sequence numbers count up from 0")
check("".join(e.delta for e in raw if e.type == "response.output_text.delta") == r.output_text, "deltas add up to the text")
check(raw[-1].type == "response.completed" and raw[-1].response.output_text == r.output_text, f"last {raw[-1].type}")

# The output budget.
short = client.responses.create(model=MODEL, input=ASK, max_output_tokens=2, temperature=0)
check(short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens", f"cut: {short.status} {short.incomplete_details}")
check(short.usage.output_tokens == 2, f"two tokens: {short.usage}")
cut = list(client.responses.create(model=MODEL, input=ASK, max_output_tokens=2, temperature=0, stream=True))
check(cut[-1].type == "response.incomplete" and cut[-1].response.incomplete_details.reason == "max_output_tokens", f"{cut[-1]}")

# Tools: a forced call, whole and streamed, then its output answered.
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
for choice in ("required", {"type": "function", "name": "get_weather"}):
    call = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=TOOLS, tool_choice=choice, temperature=0)
    calls = [o for o in call.output if o.type == "function_call"]
    check(len(calls) >= 1 and calls[0].name == "get_weather" and calls[0].call_id, f"{choice}: a call {call.output}")
    check("city" in json.loads(calls[0].arguments), f"{choice}: arguments {calls[0].arguments}")
    with client.responses.stream(model=MODEL, input="What is the weather in Paris?", tools=TOOLS, tool_choice=choice, temperature=0) as s:
        kinds = [e.type for e in s]
        streamed = s.get_final_response()
    scalls = [o for o in streamed.output if o.type == "function_call"]
    check("response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds, f"{kinds}")
    check([(c.name, c.arguments) for c in scalls] == [(c.name, c.arguments) for c in calls], f"streamed {scalls} vs {calls}")
answer = client.responses.create(
    model=MODEL,
    previous_response_id=call.id,
    input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 degrees and sunny"}],
    tools=TOOLS,
    temperature=0,
    max_output_tokens=40,
)
check(answer.status in ("completed", "incomplete") and answer.output and answer.previous_response_id == call.id, f"{answer}")
check(answer.usage.input_tokens > call.usage.input_tokens, f"the call and its output are in the prompt: {answer.usage} vs {call.usage}")

# A two-turn conversation; instructions do not carry over.
first = client.responses.create(model=MODEL, input="My name is Ada.", instructions="Answer in five words.", temperature=0, max_output_tokens=16)
second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id, temperature=0, max_output_tokens=16)
alone = client.responses.create(model=MODEL, input="What is my name?", temperature=0, max_output_tokens=16)
check(second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens, f"{second.usage} vs {alone.usage}")
check(second.instructions is None and first.instructions, "instructions stay with their response")

# Structured output.
short_string = {"type": "string", "maxLength": 24}
schema = {"type": "object", "properties": {"city": short_string, "country": short_string}, "required": ["city", "country"], "additionalProperties": False}
js = client.responses.create(
    model=MODEL,
    input="Name a city and its country.",
    text={"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}},
    temperature=0,
    max_output_tokens=128,
)
check(js.status == "completed", f"a whole object: {js.status} {js.output_text!r}")
place = json.loads(js.output_text)
check(isinstance(place, dict) and {"city", "country"} <= place.keys(), f"schema'd output {js.output_text!r}")

# The store.
got = client.responses.retrieve(r.id)
check(got.id == r.id and got.output_text == r.output_text, f"retrieve {got}")
client.responses.delete(r.id)
try:
    client.responses.retrieve(r.id)
    check(False, "a deleted response is gone")
except openai.NotFoundError:
    check(True, "")
unstored = client.responses.create(model=MODEL, input=ASK, store=False, max_output_tokens=4, temperature=0)
try:
    client.responses.retrieve(unstored.id)
    check(False, "store=False keeps nothing")
except openai.NotFoundError:
    check(True, "")

# Errors name what is wrong.
for kwargs, name in [
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ({"tools": [{"type": "web_search"}]}, "web_search"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
]:
    try:
        client.responses.create(model=MODEL, input="hi", **kwargs)
        check(False, f"{name}: accepted")
    except openai.BadRequestError as e:
        check(name in str(e), f"{name}: {e}")
try:
    client.responses.create(model=MODEL, input="hi", previous_response_id="resp_nope")
    check(False, "an unknown previous_response_id is refused")
except openai.NotFoundError as e:
    check("resp_nope" in str(e), f"{e}")

print(f"openai_responses.py: {passed} checks passed")
