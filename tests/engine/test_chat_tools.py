"""Tools in the chat: OpenAI's tool messages and `tools` checked and handed to templates in Hugging Face's shape,
the smollm2-tools template, --chat-template / EngineConfig.chat_template, the protocol's chat_options.tools, and
the grammars that force a call (tool_choice)."""

import argparse
import dataclasses
import json
import os
import random

import jsonschema
import llguidance as lg
import msgpack
import numpy as np
import pytest

from rawinfer.config import ModelConfig
from rawinfer.engine.chat_messages import check_tools, template_messages
from rawinfer.engine.tokenizer import ChatTemplateError, Tokenizer, load_chat_template, render_chat
from rawinfer.engine.tool_calls import parse_tool_calls
from rawinfer.engine.tool_grammar import tool_call_grammar
from rawinfer.frontends.options import Parser, add_engine_args, engine_config_from_args
from rawinfer.settings import TEMPLATES_DIR
from rawinfer.frontends.server import protocol as P

TOOLS_TEMPLATE = os.path.join(TEMPLATES_DIR, "smollm2-tools.jinja")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city {now}, \"live\"",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock.now", "description": "The time"}}
TOOLS = [WEATHER, CLOCK]
CALLED = {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
LOOP = [{"role": "user", "content": "Weather in Paris?"}, CALLED,
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]


# ---- messages and tools in the template's shape -------------------------------------------------------------

def test_template_messages_shape():
    """Arguments become a dict, null content "", text parts joined, nulls dropped; the caller's dicts untouched."""
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    out = template_messages([parts, CALLED, LOOP[2], {"role": "assistant", "content": "x", "tool_calls": None}])
    assert out[0] == {"role": "user", "content": "a\nb"}
    assert out[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert out[2] == LOOP[2] and out[3] == {"role": "assistant", "content": "x"}
    assert CALLED["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}' and CALLED["refusal"] is None
    empty = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": ""}}]}
    assert template_messages([empty])[0]["tool_calls"][0] == {"type": "function", "function": {"name": "f",
                                                                                              "arguments": {}}}


@pytest.mark.parametrize("message, words", [
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]},
     r"messages\[0\].tool_calls\[0\].function.arguments must be a JSON object in a string"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}, "JSON object"),
    ({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}, r"function.name must be a non-empty"),
    ({"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "f"}}]}, r"\.type must be \"function\""),
    ({"role": "assistant", "tool_calls": {"name": "f"}}, r"tool_calls must be a list"),
    ({"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}, "only assistant messages"),
    ({"role": "tool", "content": "x", "tool_call_id": 7}, r"messages\[0\].tool_call_id must be a string"),
    ({"role": "tool", "content": None}, r"needs a string \"content\""),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, r"content\[0\] must be a .*text only"),
])
def test_bad_messages_named(message, words):
    with pytest.raises(ValueError, match=words):
        template_messages([message])


@pytest.mark.parametrize("tools, words", [
    ({"type": "function"}, "tools must be a list"),
    ([{"name": "f"}], r"tools\[0\] must be a map of \"type\": \"function\""),
    ([{"type": "function", "function": {"name": "a b"}}], r"tools\[0\].function.name must be 1 to 64 letters"),
    ([{"type": "function", "function": {"name": "x" * 65}}], "1 to 64"),
    ([WEATHER, WEATHER], r"tools\[1\].function.name 'get_weather' is taken by tools\[0\]"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "schema of an object"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], "description must be a string"),
])
def test_bad_tools_named(tools, words):
    with pytest.raises(ValueError, match=words):
        check_tools(tools)
    assert check_tools(None) is None and check_tools([]) is None and check_tools(TOOLS) is TOOLS


# ---- rendering --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_tok(smollm2_dir):
    return Tokenizer.from_dir(smollm2_dir, ModelConfig.from_dir(smollm2_dir))


@pytest.fixture(scope="module")
def tools_tok(smollm2_dir):
    cfg = dataclasses.replace(ModelConfig.from_dir(smollm2_dir), chat_template=load_chat_template(TOOLS_TEMPLATE))
    return Tokenizer.from_dir(smollm2_dir, cfg)


@pytest.mark.parametrize("chat", [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
    [],
])
def test_tools_template_without_tools_is_smollm2s(smollm2_tok, tools_tok, chat):
    for gen in (True, False):
        assert render_chat(tools_tok, chat, add_generation_prompt=gen) == \
            (render_chat(smollm2_tok, chat, add_generation_prompt=gen) if chat or gen else "")


def test_tools_template_renders_the_loop(tools_tok):
    text = render_chat(tools_tok, LOOP + [{"role": "tool", "tool_call_id": "c2", "content": "rain"}], tools=TOOLS)
    system, _, rest = text.partition("<|im_end|>\n")
    assert system.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert "\n<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n" + json.dumps(CLOCK) + "\n</tools>" in system
    assert rest == ("<|im_start|>user\nWeather in Paris?<|im_end|>\n"
                    "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}"
                    "\n</tool_call><|im_end|>\n"
                    "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n<tool_response>\nrain\n"
                    "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_parsed_call_renders_back_as_written(tools_tok):
    """A call parsed from the model's text and sent back (as a client does) renders to that same text, so the
    next turn's prompt extends the last one (prefix-cache hits)."""
    written = "Let me check.\n" + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    content, calls = parse_tool_calls(written, "hermes")
    msg = {"role": "assistant", "content": content, "tool_calls": [c.openai() for c in calls]}
    assert render_chat(tools_tok, [LOOP[0], msg], add_generation_prompt=False).endswith(
        "<|im_start|>assistant\n" + written + "<|im_end|>\n")


def test_templates_get_arguments_as_a_dict(tools_tok):
    """Templates that iterate the arguments (or test `is mapping`) get a dict; `tools` reach the variable."""
    tpl = ("{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.name }}("
           "{% for k, v in c.function.arguments.items() %}{{ k }}={{ v }}{% endfor %})"
           "{{ c.function.arguments is mapping }}{% endfor %}{% endfor %}|{{ tools | map(attribute='function.name') "
           "| join(',') }}")
    tok = Tokenizer(tools_tok._hf, dataclasses.replace(tools_tok.config, chat_template=tpl))
    assert render_chat(tok, LOOP, tools=TOOLS, add_generation_prompt=False) == "get_weather(city=Paris)True|get_weather,clock.now"
    with pytest.raises(ValueError, match=r"tools\[0\] must be a map"):
        render_chat(tok, LOOP, tools=[{"name": "f"}])


def test_continue_with_tools(tools_tok):
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well,"}]
    text = render_chat(tools_tok, chat, add_generation_prompt=False, continue_final_message=True, tools=TOOLS)
    assert "<tools>" in text and text.endswith("<|im_start|>assistant\nWell,")


# ---- the chat template option -----------------------------------------------------------------------------

def test_load_chat_template_refuses_bad_files(tmp_path):
    assert "tool_call" in load_chat_template(TOOLS_TEMPLATE)
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match=r"bad.jinja is not valid Jinja2 \(line 1: .*\); fix the file$"):
        load_chat_template(str(bad))
    bad.write_text("  \n")
    with pytest.raises(ChatTemplateError, match="is empty"):
        load_chat_template(str(bad))
    bad.write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(ChatTemplateError, match="cannot read the chat template .*UTF-8"):
        load_chat_template(str(bad))


def test_chat_template_option(tmp_path):
    p = Parser(prog="rawinfer generate")
    add_engine_args(p)
    args = p.parse_args(["--chat-template", "smollm2-tools"])
    assert engine_config_from_args(args).chat_template == TOOLS_TEMPLATE
    assert p.parse_args(["--chat-template", TOOLS_TEMPLATE]).chat_template == TOOLS_TEMPLATE
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--chat-template", str(tmp_path / "none.jinja")])
    assert e.value.code == 2
    assert p.parse_args([]).chat_template is None
    from rawinfer.config import EngineConfig
    with pytest.raises(ValueError, match="chat_template=.*it must be an existing file"):
        EngineConfig(chat_template=str(tmp_path / "none.jinja")).validate()


def test_engine_takes_the_template_or_refuses_it(tiny_llama_dir, tmp_path):
    from rawinfer import LLMEngine
    bad = tmp_path / "bad.jinja"
    bad.write_text("{{ unclosed ")
    with pytest.raises(ChatTemplateError, match="not valid Jinja2"):
        LLMEngine(tiny_llama_dir, device="cpu", kv_cache_memory="16MiB", warmup=False, chat_template=str(bad))
    engine = LLMEngine(tiny_llama_dir, device="cpu", kv_cache_memory="16MiB", warmup=False,
                       chat_template=TOOLS_TEMPLATE)
    assert engine.model_config.chat_template == load_chat_template(TOOLS_TEMPLATE)


# ---- the protocol -----------------------------------------------------------------------------------------

def test_protocol_carries_tool_messages_and_tools():
    msg = P.Generate(request_id="r", messages=LOOP, chat_options={"tools": TOOLS})
    assert P.decode_request(P.encode(msg)) == msg
    assert "chat_options" not in msgpack.unpackb(P.encode(P.Tokenize(messages=LOOP)))
    for chat, options, words in (
            ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}], None,
             r"field 'messages' of .* is invalid: messages\[0\].tool_calls\[0\].function.arguments"),
            (LOOP, {"tools": [{"type": "function", "function": {}}]},
             r"field 'chat_options' .* is invalid: chat_options.tools\[0\].function.name"),
            ([], None, "non-empty list")):
        body = {"v": 1, "type": "generate", "request_id": "r", "messages": chat}
        if options:
            body["chat_options"] = options
        with pytest.raises(P.ProtocolError, match=words):
            P.decode_request(msgpack.packb(body))


# ---- forcing a call ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lltok(smollm2_dir):
    return lg.LLTokenizer(os.path.join(smollm2_dir, "tokenizer.json"))


def accepts(lltok, grammar: str, text: str) -> bool:
    m = lg.LLMatcher(lltok, grammar, log_level=0)
    return m.consume_tokens(lltok.tokenize_str(text)) and m.is_accepting()


def test_grammar_is_exactly_the_format(lltok):
    g = tool_call_grammar(TOOLS, "required", "hermes")["grammar"]
    assert lg.LLMatcher.validate_grammar(g, lltok) == ""
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    clock = '<tool_call>\n{"name": "clock.now", "arguments": {}}\n</tool_call>'
    assert accepts(lltok, g, one) and accepts(lltok, g, one + "\n" + clock)
    for bad in (one.replace("Paris", "Paris, a long name here"), one.replace('"days": 3', '"days": 9'),
                one.replace('"city"', '"town"'), one.replace('": "Paris"', '":"Paris"'), "Sure. " + one,
                clock.replace("{}", '{"x": 1}'), one.replace("get_weather", "get_news")):
        assert not accepts(lltok, g, bad), bad
    single = tool_call_grammar(TOOLS, "required", "hermes", parallel_tool_calls=False)["grammar"]
    assert accepts(lltok, single, one) and not accepts(lltok, single, one + "\n" + clock)
    named = tool_call_grammar(TOOLS, {"type": "function", "function": {"name": "clock.now"}}, "hermes")["grammar"]
    assert accepts(lltok, named, clock) and not accepts(lltok, named, one)
    llama = tool_call_grammar(TOOLS, "required", "llama3_json")["grammar"]
    assert accepts(lltok, llama, '{"name": "get_weather", "parameters": {"city": "Rome"}}; '
                                 '{"name": "clock.now", "parameters": {}}')


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_grammar_walks_parse_and_validate(lltok, parser):
    """Random walks through the grammar's token masks (a stand-in for any model): every finished text parses
    into calls of the listed functions whose arguments validate against their schemas."""
    rng = random.Random(0)
    grammar = tool_call_grammar(TOOLS, "required", parser)["grammar"]
    schemas = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "maxProperties": 0})
               for t in TOOLS}
    V = lltok.vocab_size
    closes = np.array([any(c in lltok.decode_str([t]) for c in '"}]') for t in range(V)])   # ends strings, objects
    for _ in range(8):
        m = lg.LLMatcher(lltok, grammar, log_level=0)
        ids = []
        while not m.is_stopped() and len(ids) < 400:
            allowed = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little")[:V].astype(bool)
            closing = np.flatnonzero(allowed & closes)
            token = int(rng.choice(closing if len(closing) and rng.random() < 0.6 else np.flatnonzero(allowed)))
            assert m.consume_token(token), m.get_error()
            ids.append(token)
        assert m.is_stopped() and not m.is_error()
        text = lltok.decode_str([t for t in ids if t != lltok.eos_token])
        content, calls = parse_tool_calls(text, parser)
        assert content == "" and calls, text
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])


@pytest.mark.parametrize("tools, choice, parser, words", [
    (TOOLS, "required", "mistral", "cannot be forced for the tool-call parser 'mistral'"),
    ([], "required", "hermes", "'tools' lists none"),
    (TOOLS, "auto", "hermes", "tool_choice must be \"required\" or"),
    (TOOLS, {"type": "function", "function": "f"}, "hermes", "tool_choice must be"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "hermes",
     "names the function 'nope', which 'tools' does not list; give one of get_weather, clock.now"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "strin"}}}}}], "required", "hermes", r"tools\[0\].function.parameters cannot be enforced"),
])
def test_grammar_refusals(tools, choice, parser, words):
    with pytest.raises(ValueError, match=words):
        tool_call_grammar(tools, choice, parser)


def test_server_renders_the_tools_it_is_sent(tools_tok):
    """The admission thread renders a protocol chat with its chat_options.tools (a tokenize counts what a
    generate is charged), and refuses a chat the template cannot take by name."""
    import queue
    from types import SimpleNamespace

    from rawinfer.frontends.server.admission import Admission
    admission = Admission(SimpleNamespace(tokenizer=tools_tok, max_model_len=8192), None, queue.Queue(), None)
    body = {"v": 1, "type": "tokenize", "messages": LOOP, "chat_options": {"tools": TOOLS}}
    reply = admission._convert(P.decode_request(msgpack.packb(body)))
    assert reply.token_ids == tools_tok.encode(render_chat(tools_tok, LOOP, tools=TOOLS))
    plain = admission._convert(P.decode_request(msgpack.packb({**body, "chat_options": {}})))
    assert len(plain.token_ids) < len(reply.token_ids)
    refused = admission._convert(P.Tokenize(messages=[{"role": "user", "content": "x"},
                                                      {"role": "assistant", "content": None}],
                                            chat_options={"add_generation_prompt": False,
                                                          "continue_final_message": True}))
    assert refused.code == "invalid_prompt" and "continue_final_message" in refused.message
