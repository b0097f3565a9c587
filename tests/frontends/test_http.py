"""The OpenAI-compatible HTTP API through a real `rawinfer serve` on SmolLM2, as clients use it: the official
`openai` package and raw HTTP. Greedy answers equal `rawinfer generate --json`; streams add up to the whole
answers and follow OpenAI's chunk rules (role first, finish_reason only on a choice's last chunk, a usage
chunk with no choices when asked); n > 1, several prompts, stop strings, seeds; 32 concurrent streams each
get exactly their own tokens."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from cli_util import rawinfer  # noqa: E402
from http_util import API_KEY, AUTH, http_server, openai_client, post, sse_events  # noqa: E402,F401

PROMPT = "The capital of France is"
QUESTION = "What is the tallest mountain on Earth?"


def test_health_was_503_while_the_engine_loaded_then_200(http_server):
    assert http_server.health_seen[-1] == 200
    assert 503 in http_server.health_seen, http_server.health_seen
    assert httpx.get(http_server.base_url + "/version").json()["version"]


def test_models_lists_the_served_model(http_server):
    models = openai_client(http_server).models.list()
    assert [m.id for m in models.data] == ["smollm2-135m-instruct"]
    assert models.data[0].owned_by == "rawinfer"


@pytest.mark.parametrize("chat", [False, True])
def test_greedy_answers_equal_rawinfer_generate_json(http_server, smollm2_dir, chat):
    client = openai_client(http_server)
    if chat:
        r = client.chat.completions.create(model="smollm2-135m-instruct", temperature=0, max_tokens=12,
                                           messages=[{"role": "user", "content": QUESTION}])
        text, usage = r.choices[0].message.content, r.usage
        assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    else:
        r = client.completions.create(model="smollm2-135m-instruct", prompt=PROMPT, temperature=0, max_tokens=12)
        text, usage = r.choices[0].text, r.usage
        assert r.object == "text_completion"
    g = rawinfer("generate", QUESTION if chat else PROMPT, *([] if chat else ["--raw"]), "--model", smollm2_dir,
                 "--device", "cpu", "--max-tokens", "12", "--json", "-q", timeout=300)
    assert g.returncode == 0, g.stderr
    want = json.loads(g.stdout)
    assert text == want["text"]
    assert r.choices[0].finish_reason == want["finish_reason"]
    assert usage.completion_tokens == len(want["token_ids"])
    assert usage.prompt_tokens == len(want["prompt_token_ids"])
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_a_chat_stream_adds_up_to_the_whole_answer_and_ends_with_usage(http_server):
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 10, "temperature": 0}
    whole = post(http_server, "/v1/chat/completions", body).json()
    events = sse_events(http_server, "/v1/chat/completions",
                        {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}     # OpenAI's and vLLM's opening
    assert "role" not in chunks[1]["choices"][0]["delta"] and chunks[1]["choices"][0]["delta"]["content"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]


def test_the_openai_package_streams_completions(http_server):
    client = openai_client(http_server)
    whole = client.completions.create(model="smollm2-135m-instruct", prompt=PROMPT, temperature=0, max_tokens=8)
    stream = client.completions.create(model="smollm2-135m-instruct", prompt=PROMPT, temperature=0, max_tokens=8,
                                       stream=True, stream_options={"include_usage": True})
    parts, reasons, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.text)
            reasons.append(c.finish_reason)
    assert "".join(parts) == whole.choices[0].text
    assert reasons[-1] == "length" and set(reasons[:-1]) <= {None}
    assert usage.completion_tokens == 8 and usage.prompt_tokens == whole.usage.prompt_tokens


def test_n_2_streams_interleave_both_choices_by_index(http_server):
    events = sse_events(http_server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 6, "n": 2,
                                                        "temperature": 1.0, "seed": 3, "stream": True})
    texts, reasons = {0: "", 1: ""}, {0: [], 1: []}
    for e in events[:-1]:
        (c,) = e["choices"]
        texts[c["index"]] += c["text"]
        reasons[c["index"]].append(c["finish_reason"])
    for i in (0, 1):
        assert reasons[i][-1] == "length" and set(reasons[i][:-1]) <= {None}
    whole = post(http_server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 6, "n": 2,
                                                  "temperature": 1.0, "seed": 3}).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    assert whole["usage"]["completion_tokens"] == 12
    assert [texts[0], texts[1]] == [c["text"] for c in whole["choices"]]


@pytest.mark.parametrize("prompts", [[PROMPT, "1, 2, 3, 4,"], [[504, 3458, 314], [42, 43, 44, 45]]])
def test_several_prompts_give_choices_in_prompt_order(http_server, prompts):
    r = post(http_server, "/v1/completions", {"prompt": prompts, "max_tokens": 5, "temperature": 0, "n": 2}).json()
    assert [c["index"] for c in r["choices"]] == list(range(4))
    for i, p in enumerate(prompts):
        one = post(http_server, "/v1/completions", {"prompt": p, "max_tokens": 5, "temperature": 0}).json()
        assert r["choices"][2 * i]["text"] == r["choices"][2 * i + 1]["text"] == one["choices"][0]["text"]


def test_stop_strings_end_the_text_before_them(http_server):
    body = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 20, "temperature": 0}
    free = post(http_server, "/v1/completions", body).json()["choices"][0]["text"]
    assert " 7," in free
    stopped = post(http_server, "/v1/completions", {**body, "stop": [" 7"]}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["text"] == free[:free.index(" 7")]


def test_a_seed_reproduces_a_sampled_answer(http_server):
    client = openai_client(http_server)

    def sample(seed):
        return client.completions.create(model="smollm2-135m-instruct", prompt="My favourite animal is",
                                         temperature=1.0, max_tokens=12, seed=seed).choices[0].text
    a = sample(11)
    assert sample(11) == a
    assert any(sample(s) != a for s in (12, 13))


def test_echo_puts_the_prompt_first(http_server):
    r = post(http_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True})
    plain = post(http_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0})
    assert r.json()["choices"][0]["text"] == PROMPT + plain.json()["choices"][0]["text"]


def test_32_concurrent_streams_each_get_their_own_tokens(http_server):
    prompts = [f"Write the number {i} in words:" for i in range(32)]
    # one request with every prompt: the engine's batch-invariant answers, one choice each
    batch = post(http_server, "/v1/completions", {"prompt": prompts, "max_tokens": 6, "temperature": 0,
                                                  "ignore_eos": True}).json()
    want = [c["text"] for c in batch["choices"]]

    async def stream(client: httpx.AsyncClient, prompt: str) -> str:
        text = ""
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def main() -> list[str]:
        async with httpx.AsyncClient(base_url=http_server.base_url, headers=AUTH, timeout=120,
                                     limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*(stream(client, p) for p in prompts))

    assert asyncio.run(main()) == want
    assert len(set(want)) > 16                 # distinct answers: a mix-up between streams would show


def test_completion_logprobs_and_echoed_prompt_logprobs(http_server):
    r = post(http_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                              "logprobs": 2}).json()["choices"][0]
    lp = r["logprobs"]
    assert "".join(lp["tokens"]) == r["text"] and len(lp["token_logprobs"]) == 4
    for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert value <= 0 and tok in top and len(top) <= 3
        assert max(top.values()) == value               # greedy: the chosen token is the most likely
    assert lp["text_offset"][0] == 0
    # evaluation harnesses: echo + logprobs + max_tokens 0 scores the prompt alone
    e = post(http_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True,
                                              "logprobs": 1}).json()
    c = e["choices"][0]
    assert c["text"] == PROMPT and e["usage"]["completion_tokens"] == 0
    assert c["logprobs"]["token_logprobs"][0] is None and len(c["logprobs"]["tokens"]) == e["usage"]["prompt_tokens"]
    assert all(v <= 0 for v in c["logprobs"]["token_logprobs"][1:])
    assert "".join(c["logprobs"]["tokens"]) == PROMPT


def test_chat_logprobs_through_the_openai_package(http_server):
    client = openai_client(http_server)
    r = client.chat.completions.create(model="smollm2-135m-instruct", temperature=0, max_tokens=5, logprobs=True,
                                       top_logprobs=3, messages=[{"role": "user", "content": QUESTION}])
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert b"".join(bytes(t.bytes) for t in content).decode() == r.choices[0].message.content
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == t.logprob for t in content)
    stream = client.chat.completions.create(model="smollm2-135m-instruct", temperature=0, max_tokens=5,
                                            logprobs=True, messages=[{"role": "user", "content": QUESTION}],
                                            stream=True)
    streamed = [t for chunk in stream for c in chunk.choices if c.logprobs for t in c.logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]


def test_logprob_bytes_of_tokens_that_split_a_character_join_into_it(smollm2_dir):
    """SmolLM2 spells a CJK character or an emoji over several byte-level tokens; alone each decodes to
    U+FFFD, and the `bytes` of the chat entries (top alternatives too) are the token's own bytes."""
    from rawinfer.config import ModelConfig
    from rawinfer.engine.tokenizer import Tokenizer
    from rawinfer.frontends.http.logprobs import TokenTexts, chat_content
    from rawinfer.frontends.server import protocol as P
    text = "Tokyo is 東京 🙂."
    ids = Tokenizer.from_dir(smollm2_dir, ModelConfig.from_dir(smollm2_dir)).encode(text, add_special_tokens=False)
    texts = TokenTexts(smollm2_dir)
    record = P.Logprobs(token_ids=ids, logprobs=[-0.5] * len(ids), ranks=[1] * len(ids),
                        top_token_ids=[[t] for t in ids], top_logprobs=[[-0.5]] * len(ids))
    entries = chat_content(texts, record)
    assert any(e["token"] == "\ufffd" for e in entries)
    assert b"".join(bytes(e["bytes"]) for e in entries).decode() == text
    assert [e["top_logprobs"][0]["bytes"] for e in entries] == [e["bytes"] for e in entries]


def test_logit_bias_and_penalties_reach_the_sampler(http_server):
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    first = post(http_server, "/v1/completions", {**body, "logprobs": 0}).json()["choices"][0]
    tok = post(http_server, "/tokenize", {"prompt": first["logprobs"]["tokens"][0]}).json()["tokens"][-1]
    banned = post(http_server, "/v1/completions", {**body, "logit_bias": {str(tok): -100}}).json()
    assert not banned["choices"][0]["text"].startswith(first["logprobs"]["tokens"][0])
    r = post(http_server, "/v1/completions", {**body, "presence_penalty": 1.5, "frequency_penalty": 0.5})
    assert r.status_code == 200


def test_tokenize_and_detokenize_round_trip(http_server):
    t = post(http_server, "/tokenize", {"prompt": PROMPT}).json()
    assert t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] == 8192
    assert post(http_server, "/detokenize", {"tokens": t["tokens"]}).json()["prompt"] == PROMPT
    chat = post(http_server, "/tokenize", {"messages": [{"role": "user", "content": QUESTION}]}).json()
    r = post(http_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": QUESTION}],
                                                   "max_tokens": 1}).json()
    assert chat["count"] == r["usage"]["prompt_tokens"]
    assert post(http_server, "/detokenize", {"tokens": [10 ** 7]}).status_code == 400


def test_chat_continues_the_final_assistant_message(http_server):
    """vLLM's continue_final_message: the answer continues the assistant's beginning instead of starting a new
    turn; /tokenize with the same options counts the prompt the chat is charged; options that cannot apply are
    a 400 naming the field."""
    chat = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    r = post(http_server, "/v1/chat/completions", {"messages": chat, "max_tokens": 3, "temperature": 0, **options})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"].startswith(" Paris")
    counted = post(http_server, "/tokenize", {"messages": chat, **options}).json()["count"]
    assert body["usage"]["prompt_tokens"] == counted
    closed = post(http_server, "/tokenize", {"messages": chat, "add_generation_prompt": False}).json()["count"]
    opened = post(http_server, "/tokenize", {"messages": chat}).json()["count"]
    assert counted < closed < opened                      # without <|im_end|>, then without the new header
    plain = post(http_server, "/tokenize", {"messages": chat}).json()["tokens"]
    kw = {"messages": chat, "chat_template_kwargs": {"enable_thinking": False}}   # a variable SmolLM2's ignores
    assert post(http_server, "/tokenize", kw).json()["tokens"] == plain
    r = post(http_server, "/v1/chat/completions", {**kw, "max_tokens": 1, "chat_template_kwargs": {"messages": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text
    for bad in ({"continue_final_message": True},
                {"add_generation_prompt": False, "continue_final_message": True, "messages": chat[:1]}):
        r = post(http_server, "/v1/chat/completions", {"messages": chat, "max_tokens": 3, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


def test_bench_serve_drives_the_http_api(http_server, tmp_path):
    out = tmp_path / "serve.json"
    r = rawinfer("bench", "serve", "--backend", "openai", "--base-url", http_server.base_url, "--api-key", API_KEY,
                 "--num-requests", "4", "--input-len", "8", "--output-len", "4", "--request-rate", "20",
                 "--json", str(out), "--figure", "", "-q", timeout=300)
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    assert result["completed"] == 4 and result["failed"] == 0 and result["output_tokens"] == 16
    assert result["ttft_ms"]["p50"] > 0 and "api_key" not in result["config"]
    r = rawinfer("bench", "serve", "--backend", "openai", "--base-url", http_server.base_url, "--num-requests", "1",
                 "--output-dir", str(tmp_path), timeout=60)
    assert r.returncode == 1 and "401" in r.stderr
