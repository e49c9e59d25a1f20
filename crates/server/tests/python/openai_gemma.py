"""The official `openai` client against `vellum serve --model gemma3-270m`
(a base model: SentencePiece tokenizer, K-quants, no chat template).

Usage: python3 openai_gemma.py BASE_URL_WITHOUT_TEMPLATE BASE_URL_WITH_TEMPLATE
The expected greedy text is the golden reference's (../shared/golden).
"""
import sys

import openai

PLAIN, TEMPLATED = sys.argv[1], sys.argv[2]
PROMPT = "The three primary colors of light are"
EXPECTED = " red, blue, and yellow.\n\nThe primary colors of light are red,"
passed = 0

client = openai.OpenAI(base_url=PLAIN + "/v1", api_key="none", max_retries=0, timeout=300)
model = client.models.list().data[0].id

# Completions: greedy text equals the float64 reference's, streamed or not.
r = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0)
assert r.choices[0].text == EXPECTED, r.choices[0].text
assert r.usage.prompt_tokens == 8 and r.usage.completion_tokens == 16, r.usage
streamed = "".join(c.choices[0].text for c in client.completions.create(
    model=model, prompt=PROMPT, max_tokens=16, temperature=0, stream=True) if c.choices)
assert streamed == EXPECTED, streamed
passed += 1

# Byte-fallback characters come back whole, in text and in echo.
r = client.completions.create(model=model, prompt="Beaver: 🦫, rare character: 龘", max_tokens=1, temperature=0, echo=True)
assert r.choices[0].text.startswith("Beaver: 🦫, rare character: 龘"), r.choices[0].text
passed += 1

# No chat template: a 400 that says how to give one.
try:
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    raise AssertionError("chat without a template must fail")
except openai.BadRequestError as e:
    assert "--chat-template" in str(e), e
passed += 1

# With a template, <end_of_turn> (id 106) ends generation: forced here by a
# logit bias, since the base model rarely emits it on its own.
client = openai.OpenAI(base_url=TEMPLATED + "/v1", api_key="none", max_retries=0, timeout=300)
chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8,
                                      temperature=0, logit_bias={"106": 100})
assert chat.choices[0].finish_reason == "stop", chat
assert chat.choices[0].message.content == "" and chat.usage.completion_tokens == 1, chat
assert chat.usage.prompt_tokens == 12, chat.usage  # <bos><start_of_turn>user\nSay hi.<end_of_turn>\n<start_of_turn>model\n
passed += 1

print(f"{passed} passed, 0 failed")
