"""LLM.chat with tools: the template lists them, a tool_choice grammar forces a call, and the engine's parser
reads it back as OpenAI's message, as the HTTP API does."""

from __future__ import annotations

import json
import os

import pytest

from rawinfer import LLM, SamplingParams
from rawinfer.engine.chat_output import parse_chat_output
from rawinfer.engine.tool_grammar import tool_call_grammar
from rawinfer.settings import TEMPLATES_DIR

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                                          "required": ["city"]}}}


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(smollm2_dir, kv_cache_memory="32MiB", chat_template=os.path.join(TEMPLATES_DIR, "smollm2-tools.jinja"))


def test_chat_lists_tools_and_a_forced_call_parses(llm):
    chat = [{"role": "user", "content": "What is the weather in Oslo?"}]
    plain = llm.chat(chat, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0]
    params = SamplingParams(max_tokens=60, temperature=0,
                            structured_outputs=tool_call_grammar([WEATHER], "required", "hermes", False))
    out = llm.chat(chat, params, use_tqdm=False, tools=[WEATHER])[0]
    assert len(out.outputs[0].token_ids) > 0 and out.finish_reason == "stop"
    msg = parse_chat_output(out.text, tools="hermes").message()
    assert msg["content"] is None and msg["tool_calls"][0]["function"]["name"] == "get_weather"
    assert set(json.loads(msg["tool_calls"][0]["function"]["arguments"])) == {"city"}
    assert len(out.prompt_token_ids) > len(plain.prompt_token_ids)       # the tools were rendered into the prompt
