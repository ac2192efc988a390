"""The official `openai` client against `tessera serve`: completions, chat,
streaming and errors, as a user's program calls them. Prints one JSON
object with what it saw; exits non-zero on any surprise.

    python openai_client.py BASE_URL API_KEY MODEL
"""

import json
import sys

import openai

base_url, api_key, model = sys.argv[1:4]
client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
seen = {}

completion = client.completions.create(model=model, prompt="the cat sat", max_tokens=5, temperature=0, logprobs=1)
choice = completion.choices[0]
assert completion.object == "text_completion", completion
assert choice.finish_reason in ("stop", "length"), choice
assert len(choice.logprobs.tokens) == completion.usage.completion_tokens, completion
seen["completion"] = {"text": choice.text, "tokens": completion.usage.completion_tokens}

chat = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "the dog"}], max_tokens=6, temperature=0
)
assert chat.choices[0].message.role == "assistant", chat
seen["chat"] = {"text": chat.choices[0].message.content, "tokens": chat.usage.completion_tokens}

pieces, finish, usage = [], None, None
stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "the dog"}],
    max_tokens=6,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
)
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage.completion_tokens
    for c in chunk.choices:
        pieces.append(c.delta.content or "")
        finish = c.finish_reason or finish
assert finish in ("stop", "length"), finish
seen["stream"] = {"text": "".join(pieces), "tokens": usage}

try:
    client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    raise AssertionError("an unknown model was served")
except openai.NotFoundError as e:
    seen["not_found"] = e.status_code
try:
    client.completions.create(model=model, prompt="x", max_tokens=0)
    raise AssertionError("max_tokens=0 was accepted")
except openai.BadRequestError as e:
    seen["bad_request"] = {"status": e.status_code, "param": e.body.get("param") if isinstance(e.body, dict) else None}
try:
    openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
    raise AssertionError("a wrong key was accepted")
except openai.AuthenticationError as e:
    seen["unauthorized"] = e.status_code
seen["models"] = [m.id for m in client.models.list().data]

print(json.dumps(seen))
