#!/usr/bin/env python3
"""Renders the chat-template fixtures of tessera-serve's prompt tests as
Hugging Face transformers renders them, to check the expected strings the
Rust tests assert (runtime/serve/src/prompt/tests/templates.rs).

The environment is transformers' own (`_compile_jinja_template` in
transformers/utils/chat_template_utils.py): an ImmutableSandboxedEnvironment
with trim_blocks, lstrip_blocks and the loop-controls extension, its `tojson`
(json.dumps with ensure_ascii=False), `raise_exception` and `strftime_now`
(here at a fixed time, in UTC, as the Rust tests fix it). The context is what
`apply_chat_template` passes: messages, tools, documents,
add_generation_prompt, the special tokens, then the extra keyword arguments.

Only jinja2 is needed (transformers is not):

    pip install jinja2
    python scripts/chat-template-reference.py

It prints each case's rendering as a Rust string literal, or the message a
template raised. The cases mirror the Rust tests; change both together.
"""

import datetime
import json
import pathlib

from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "runtime/serve/src/prompt/tests/chat_templates"
NOW = datetime.datetime(2025, 1, 15, 9, 30, tzinfo=datetime.timezone.utc)


def environment():
    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return NOW.strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def msg(role, content, **extra):
    return {"role": role, "content": content, **extra}


SYSTEM_CHAT = [
    msg("system", "You are a helpful assistant."),
    msg("user", "Hello!"),
    msg("assistant", "  Hi there.  "),
    msg("user", "What is 2+2? héllo 😀"),
]
PLAIN_CHAT = [msg("user", "Hello!"), msg("assistant", "Hi there."), msg("user", "What is 2+2?")]
# Keys in sorted order: the Rust side's tool schemas are serde_json values,
# whose objects sort their keys (see docs/serving.md).
WEATHER_TOOL = {
    "function": {
        "description": "The weather in a city",
        "name": "get_weather",
        "parameters": {"properties": {"city": {"type": "string"}}, "required": ["city"], "type": "object"},
    },
    "type": "function",
}
TOOL_CHAT = [
    msg("system", "You are a weather bot."),
    msg("user", "Weather in Paris?"),
    msg("assistant", None, tool_calls=[{"function": {"arguments": {"city": "Paris", "unit": "°C"}, "name": "get_weather"}, "id": "call_1", "type": "function"}]),
    msg("tool", "21 degrees"),
]

LLAMA3 = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
MISTRAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
GEMMA = {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>"}
QWEN = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
ZEPHYR = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}

# (case, template, messages, add_generation_prompt, tools, special tokens, kwargs)
CASES = [
    ("llama3_system_chat", "llama-3-instruct", SYSTEM_CHAT, True, None, LLAMA3, {}),
    ("llama3_no_generation_prompt", "llama-3-instruct", PLAIN_CHAT, False, None, LLAMA3, {}),
    ("qwen2_system_chat", "qwen2-chatml", SYSTEM_CHAT, True, None, QWEN, {}),
    ("qwen2_default_system", "qwen2-chatml", PLAIN_CHAT, False, None, QWEN, {}),
    ("mistral_chat", "mistral-instruct", PLAIN_CHAT, True, None, MISTRAL, {}),
    ("mistral_system_raises", "mistral-instruct", SYSTEM_CHAT, True, None, MISTRAL, {}),
    ("mistral_two_users_raise", "mistral-instruct", [msg("user", "a"), msg("user", "b")], True, None, MISTRAL, {}),
    ("zephyr_system_chat", "zephyr", SYSTEM_CHAT, True, None, ZEPHYR, {}),
    ("zephyr_no_generation_prompt", "zephyr", PLAIN_CHAT, False, None, ZEPHYR, {}),
    ("gemma_chat", "gemma", PLAIN_CHAT, True, None, GEMMA, {}),
    ("gemma_system_raises", "gemma", SYSTEM_CHAT, True, None, GEMMA, {}),
    ("llama32_dated_chat", "llama-3.2-instruct", SYSTEM_CHAT, True, None, LLAMA3, {}),
    ("llama32_date_kwarg", "llama-3.2-instruct", PLAIN_CHAT, True, None, LLAMA3, {"date_string": "01 Jan 2030"}),
    ("llama32_tools", "llama-3.2-instruct", TOOL_CHAT, True, [WEATHER_TOOL], LLAMA3, {}),
    ("qwen25_chat", "qwen2.5-instruct", PLAIN_CHAT, True, None, QWEN, {}),
    ("qwen25_tools", "qwen2.5-instruct", TOOL_CHAT, True, [WEATHER_TOOL], QWEN, {}),
]


def rust_literal(s):
    return json.dumps(s, ensure_ascii=False)


def main():
    env = environment()
    for case, template, messages, generation, tools, special, kwargs in CASES:
        compiled = env.from_string((FIXTURES / f"{template}.jinja").read_text())
        try:
            out = compiled.render(messages=messages, tools=tools, documents=None, add_generation_prompt=generation, **special, **kwargs)
            print(f"{case}: {rust_literal(out)}")
        except TemplateError as e:
            print(f"{case}: raises {rust_literal(str(e))}")


if __name__ == "__main__":
    main()
