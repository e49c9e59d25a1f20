"""The official `openai` client against `vellum serve` on a non-default
device: the endpoints work and greedy text equals the CPU backend's.

Usage: python3 openai_device.py BASE_URL EXPECTED_GREEDY_TEXT
"""
import sys

import openai

BASE, EXPECTED = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=BASE + "/v1", api_key="none", max_retries=0, timeout=300)
model = client.models.list().data[0].id

r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
text = r.choices[0].text
assert text == EXPECTED, f"greedy text {text!r} differs from the CPU backend's {EXPECTED!r}"
assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length", r

chunks = list(client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0,
                                        stream=True, stream_options={"include_usage": True}))
streamed = "".join(c.choices[0].text for c in chunks if c.choices)
assert streamed == text, (streamed, text)
assert chunks[-1].usage.completion_tokens == 8, chunks[-1]

chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                      temperature=0, max_tokens=6, logprobs=True, top_logprobs=2)
assert chat.choices[0].message.content, chat
assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens, chat
print("3 passed, 0 failed")
