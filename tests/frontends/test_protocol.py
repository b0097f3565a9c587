"""The wire protocol: every message round-trips, and every kind of bad input is a ProtocolError with a clear message."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rawinfer.sampling import SamplingParams
from rawinfer.frontends.server import protocol as P
from rawinfer.frontends.client.client import Completion, make_generate


def raw(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def gen(**fields) -> dict:
    return {"v": P.PROTOCOL_VERSION, "type": "generate", "request_id": "r1", "prompt": [1, 2, 3], **fields}


CLIENT_EXAMPLES = [
    P.Generate("r1", prompt="Hello there"),
    P.Generate("r2", prompt=[1, 2, 3], params={"max_tokens": 5, "temperature": 0.0, "stop": ["\n"]}, stream=False,
               priority=-3),
    P.Generate("r3", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]),
    P.Abort("r1"),
    P.Stats(),
    P.Stats(tag="t7"),
    P.Ping(tag="x"),
    P.ModelInfo(),
]

SERVER_EXAMPLES = [
    P.Chunk("r1", 0, [17], "He"),
    P.Chunk("r1", 2, [], ""),
    P.Final("r1", 0, [5, 6], "llo", "stop", [1, 2, 3], P.Usage(3, 0, 9), P.Timings(0.01, 0.002, 0.5)),
    P.Final("r1", 1, [], "", "abort", [1], P.Usage(1, 1, 0), P.Timings(None, None, 0.1)),
    P.Final("r9", 0, [], "", "error", [1], P.Usage(1, 0, 0), P.Timings(None, None, None), error="the engine failed"),
    P.Error("invalid_params", "temperature must be >= 0", request_id="r1"),
    P.Error("bad_msgpack", "not msgpack"),
    P.Pong(1234.5, tag="t1"),
    P.StatsReply({"running": 1, "kv_usage": 0.25, "nested": {"a": [1, 2]}}, tag="t2"),
    P.ModelInfoReply({"vocab_size": 512, "model": None}),
    P.Heartbeat(),
]


@pytest.mark.parametrize("msg", CLIENT_EXAMPLES, ids=lambda m: m.TYPE)
def test_client_messages_round_trip(msg):
    data = P.encode(msg)
    assert P.decode_request(data) == msg
    body = msgpack.unpackb(data)
    assert body["v"] == P.PROTOCOL_VERSION and body["type"] == msg.TYPE


@pytest.mark.parametrize("msg", SERVER_EXAMPLES, ids=lambda m: m.TYPE)
def test_server_messages_round_trip(msg):
    data = P.encode(msg)
    assert P.decode_reply(data) == msg
    assert msgpack.unpackb(data)["v"] == P.PROTOCOL_VERSION


def test_directions_are_separate():
    """A server message sent to the server (or the reverse) is an unknown type, not silently accepted."""
    with pytest.raises(P.ProtocolError) as e:
        P.decode_request(P.encode(P.Pong(1.0)))
    assert e.value.code == P.ErrorCode.UNKNOWN_TYPE and "generate" in e.value.message
    with pytest.raises(P.ProtocolError):
        P.decode_reply(P.encode(P.Ping()))


def test_numpy_scalars_in_stats_are_encoded_as_plain_numbers():
    msg = P.StatsReply({"kv_usage": np.float32(0.5), "running": np.int64(3)})
    assert P.decode_reply(P.encode(msg)).stats == {"kv_usage": 0.5, "running": 3}


@pytest.mark.parametrize("version", [0, 2, 99, "1", 1.0, True, None, [1]])
def test_unknown_version_names_the_supported_ones(version):
    with pytest.raises(P.ProtocolError) as e:
        P.decode_request(raw({**gen(), "v": version}))
    assert e.value.code == P.ErrorCode.UNSUPPORTED_VERSION
    assert "version(s) 1" in e.value.message
    assert e.value.request_id == "r1"          # the reply can still name the request


def test_missing_version():
    with pytest.raises(P.ProtocolError) as e:
        P.decode_request(raw({"type": "ping"}))
    assert e.value.code == P.ErrorCode.UNSUPPORTED_VERSION


def test_unknown_type_lists_the_known_ones():
    with pytest.raises(P.ProtocolError) as e:
        P.decode_request(raw({"v": 1, "type": "launch_missiles", "tag": "t3"}))
    assert e.value.code == P.ErrorCode.UNKNOWN_TYPE
    assert "launch_missiles" in e.value.message and "generate, abort, stats, ping, model_info" in e.value.message
    assert e.value.tag == "t3"


def test_unknown_fields_are_named():
    with pytest.raises(P.ProtocolError) as e:
        P.decode_request(raw(gen(temperature=0.5)))
    assert e.value.code == P.ErrorCode.INVALID_MESSAGE
    assert "'temperature'" in e.value.message and "params" in e.value.message


def test_missing_required_field_is_named():
    with pytest.raises(P.ProtocolError) as e:
        P.decode_request(raw({"v": 1, "type": "abort"}))
    assert "request_id" in e.value.message


@pytest.mark.parametrize("fields, where", [
    ({"request_id": 7}, "request_id"),
    ({"request_id": ""}, "request_id"),
    ({"request_id": "x" * (P.MAX_ID_CHARS + 1)}, "request_id"),
    ({"prompt": {"a": 1}}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": [1, 2.0]}, "prompt"),
    ({"prompt": [True]}, "prompt"),
    ({"prompt": [2**40]}, "prompt"),
    ({"prompt": b"bytes"}, "prompt"),
    ({"prompt": None, "messages": [{"role": "user"}]}, "messages"),
    ({"prompt": None, "messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"prompt": None, "messages": "hi"}, "messages"),
    ({"params": [1, 2]}, "params"),
    ({"stream": "yes"}, "stream"),
    ({"stream": 1}, "stream"),
    ({"priority": 1.5}, "priority"),
    ({"priority": False}, "priority"),
])
def test_ill_typed_fields_are_named(fields, where):
    with pytest.raises(P.ProtocolError) as e:
        P.decode_request(raw(gen(**fields)))
    assert e.value.code == P.ErrorCode.INVALID_MESSAGE
    assert repr(where) in e.value.message


@pytest.mark.parametrize("fields", [{"prompt": None}, {"messages": [{"role": "user", "content": "hi"}]}])
def test_generate_needs_exactly_one_of_prompt_and_messages(fields):
    with pytest.raises(P.ProtocolError) as e:
        P.decode_request(raw(gen(**fields)))
    assert "exactly one of 'prompt' and 'messages'" in e.value.message


@pytest.mark.parametrize("data, code", [
    (b"", P.ErrorCode.BAD_MSGPACK),
    (b"\xc1", P.ErrorCode.BAD_MSGPACK),                              # the never-used msgpack byte
    (raw(gen())[:-3], P.ErrorCode.BAD_MSGPACK),                      # truncated
    (raw(gen()) + b"\x00", P.ErrorCode.BAD_MSGPACK),                 # trailing bytes
    (b"\xdd\xff\xff\xff\xff", P.ErrorCode.BAD_MSGPACK),              # claims 4 billion elements
    (b"\x91" * 100_000 + b"\x00", P.ErrorCode.BAD_MSGPACK),          # nested too deep
    (raw({1: 2}), P.ErrorCode.BAD_MSGPACK),                          # non-string map keys
    (raw({"v": 1, "type": "ping", "tag": msgpack.ExtType(5, b"x")}), P.ErrorCode.BAD_MSGPACK),
    (b"\xa2\xff\xfe", P.ErrorCode.BAD_MSGPACK),                      # a str that is not UTF-8
    (raw([1, "ping"]), P.ErrorCode.INVALID_MESSAGE),
    (raw("ping"), P.ErrorCode.INVALID_MESSAGE),
    (raw(None), P.ErrorCode.INVALID_MESSAGE),
])
def test_undecodable_bytes(data, code):
    with pytest.raises(P.ProtocolError) as e:
        P.decode_request(data)
    assert e.value.code == code


def test_error_replies_only_echo_well_formed_ids():
    with pytest.raises(P.ProtocolError) as e:
        P.decode_request(raw({"v": 9, "type": "generate", "request_id": "y" * 1000}))
    assert e.value.request_id is None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_never_escape_as_anything_but_protocol_errors(data):
    try:
        P.decode_request(data)
    except P.ProtocolError as e:
        assert e.message and isinstance(e.code, P.ErrorCode)


_leaf = st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=20) \
    | st.binary(max_size=20)
_values = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8),
                                                                                          inner, max_size=4),
                       max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["generate", "abort", "stats", "ping", "model_info", "nope"]),
       st.dictionaries(st.sampled_from(["request_id", "prompt", "messages", "params", "stream", "priority", "tag",
                                        "extra"]), _values, max_size=6))
def test_random_maps_decode_or_fail_cleanly(kind, fields):
    """Well-formed msgpack with arbitrary field values: either a valid message whose fields have the declared
    types, or a ProtocolError."""
    try:
        msg = P.decode_request(raw({"v": 1, "type": kind, **fields}))
    except P.ProtocolError as e:
        assert isinstance(e.code, P.ErrorCode)
        return
    assert msg.TYPE == kind
    if isinstance(msg, P.Generate):
        assert (msg.prompt is None) != (msg.messages is None)
        assert isinstance(msg.params, dict) and isinstance(msg.stream, bool)
        assert isinstance(msg.request_id, str) and msg.request_id


def test_make_generate_accepts_sampling_params_and_arrays():
    msg = make_generate(np.array([3, 4, 5]), params=SamplingParams(max_tokens=7, temperature=0.0), stream=False)
    assert msg.prompt == [3, 4, 5] and msg.params["max_tokens"] == 7 and msg.request_id
    assert P.decode_request(P.encode(msg)) == msg
    with pytest.raises(ValueError):
        make_generate()


def test_completion_exposes_the_first_sample():
    f0 = P.Final("r", 0, [1], "a", "stop", [9], P.Usage(1, 0, 1), P.Timings(0.1, None, 0.2))
    f1 = P.Final("r", 1, [2], "b", "length", [9], P.Usage(1, 0, 1), P.Timings(0.1, None, 0.2))
    c = Completion("r", [9], [f0, f1])
    assert (c.text, c.token_ids, c.finish_reason, c.usage.completion_tokens) == ("a", [1], "stop", 1)
