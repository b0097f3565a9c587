"""structured_outputs over the ZeroMQ protocol: a real `rawinfer serve` of the default model carries the field in
`params` unchanged (streamed and not, n > 1), answers as the engine does in-process, and names a grammar that
does not compile."""

from __future__ import annotations

import json
import re
import shutil
import tempfile

import jsonschema
import pytest

from rawinfer.frontends.server import protocol as P
from rawinfer.frontends.client.client import Client, RequestError

from cli_util import Server  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "population", "river"],
          "properties": {"city": {"type": "string", "maxLength": 20},
                         "population": {"type": "integer", "minimum": 0, "maximum": 50000000},
                         "river": {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]}}}
CHAT = [{"role": "user", "content": "Describe the capital of France as JSON."}]


@pytest.fixture(scope="module")
def server(smollm2_dir):
    path = tempfile.mkdtemp(prefix="rwi")
    srv = Server(smollm2_dir, addr=f"ipc://{path}/s.sock", kv="128MiB")
    try:
        srv.wait_ready(timeout_s=240)
        yield srv
    finally:
        srv.stop()
        shutil.rmtree(path, ignore_errors=True)


def collect(it) -> dict[int, tuple[str, list[int], P.Final]]:
    texts, ids, finals = {}, {}, {}
    for m in it:
        texts[m.index] = texts.get(m.index, "") + m.text
        ids[m.index] = ids.get(m.index, []) + list(m.token_ids)
        if isinstance(m, P.Final):
            finals[m.index] = m
    return {i: (texts[i], ids[i], finals[i]) for i in finals}


def test_structured_outputs_travel_in_params(server, smollm2_engine):
    from rawinfer import LLM, SamplingParams
    greedy = {"max_tokens": 120, "temperature": 0.0, "structured_outputs": {"json": SCHEMA}}
    sampled = {"max_tokens": 120, "temperature": 0.9, "seed": 4, "n": 2, "structured_outputs": {"json": json.dumps(SCHEMA)}}
    regex = {"max_tokens": 20, "temperature": 0.0, "structured_outputs": {"regex": "[A-Z][a-z]+, [0-9]{4}"}}
    with Client(server.addr, timeout_s=180) as c:
        streamed = collect(c.generate(messages=CHAT, params=greedy))
        whole = collect(c.generate(messages=CHAT, params=greedy, stream=False))
        samples = collect(c.generate(messages=CHAT, params=sampled))
        matched = collect(c.generate("The year Paris was founded:", params=regex, stream=False))
    offline = LLM.from_engine(smollm2_engine).chat(CHAT, SamplingParams(**greedy), use_tqdm=False)[0]
    assert streamed[0][:2] == whole[0][:2] == (offline.text, offline.token_ids)
    assert len(samples) == 2
    for text, _, final in [streamed[0], *samples.values()]:
        assert final.finish_reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
    assert re.fullmatch("[A-Z][a-z]+, [0-9]{4}", matched[0][0]) and matched[0][2].finish_reason == "stop"


def test_a_grammar_that_does_not_compile_is_named(server):
    bad = {"max_tokens": 5, "structured_outputs": {"regex": "(unclosed"}}
    with Client(server.addr, timeout_s=180) as c:
        try:        # found on admission (refused), or once taken in: an error final per sample
            finals = collect(c.generate("hi", params={**bad, "n": 2}))
            assert [f.finish_reason for _, _, f in finals.values()] == ["error", "error"]
            assert all("structured_outputs 'regex' does not compile" in f.error for _, _, f in finals.values())
        except RequestError as e:
            assert e.code == "rejected" and "structured_outputs 'regex' does not compile" in e.message
        with pytest.raises(RequestError, match=r"structured_outputs 'regex' does not compile: .*unclosed"):
            list(c.generate("hi", params=bad))                  # known by now: refused on arrival
        with pytest.raises(RequestError, match=r"structured_outputs=.*exactly one of the keys") as e:
            list(c.generate("hi", params={"structured_outputs": {"regex": "a", "choice": ["a"]}}))
        assert e.value.code == "invalid_params"
