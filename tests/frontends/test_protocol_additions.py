"""Protocol additions of issue 17: log-probabilities in chunks and finals, tokenize / detokenize, the new sampling
parameters. New optional fields leave the wire when unset, so version-1 peers see the messages they knew."""

from __future__ import annotations

import msgpack
import pytest

from rawinfer.frontends.server import protocol as P
from rawinfer.frontends.client.core import ClientCore, destination, make_generate

LP = P.Logprobs([5, 6], [-0.1, -2.5], [1, 3], [[5, 9], [7, 8]], [[-0.1, -3.0], [-0.5, -1.0]])
LP0 = P.Logprobs([5], [-0.25], [2], [[]], [[]])


@pytest.mark.parametrize("msg", [
    P.Tokenize(prompt="Hello"), P.Tokenize(messages=[{"role": "user", "content": "Hi"}], tag="t1"),
    P.Tokenize(prompt="x", add_special_tokens=False), P.Detokenize([1, 2, 3], tag="t2"),
    P.Detokenize([], skip_special_tokens=True),
    P.Generate("r", prompt=[1], params={"logprobs": 5, "prompt_logprobs": 0, "max_tokens": 0,
                                        "logit_bias": {"17": -100}, "presence_penalty": 0.5}),
], ids=lambda m: m.TYPE)
def test_new_client_messages_round_trip(msg):
    assert P.decode_request(P.encode(msg)) == msg


@pytest.mark.parametrize("msg", [
    P.Chunk("r", 0, [5, 6], "ab", logprobs=LP), P.Chunk("r", 1, [5], "a", LP0, LP0),
    P.Final("r", 0, [5, 6], "ab", "length", [1, 5], P.Usage(2, 0, 2), P.Timings(0.1, None, 0.2), None, LP, LP0),
    P.TokenizeReply([1, 2], 2048, "t"), P.DetokenizeReply("Hello", "t"),
], ids=lambda m: m.TYPE)
def test_new_server_messages_round_trip(msg):
    assert P.decode_reply(P.encode(msg)) == msg


def test_unset_optional_fields_leave_the_wire():
    """A chunk or final without log-probabilities is byte for byte what version 1 sent."""
    chunk = msgpack.unpackb(P.encode(P.Chunk("r", 0, [5], "a")))
    assert set(chunk) == {"v", "type", "request_id", "index", "token_ids", "text"}
    final = msgpack.unpackb(P.encode(P.Final("r", 0, [], "", "stop", [1], P.Usage(1, 0, 0), P.Timings(None, None, None))))
    assert "logprobs" not in final and "prompt_logprobs" not in final
    with_lp = msgpack.unpackb(P.encode(P.Chunk("r", 0, [5, 6], "ab", LP)))
    assert with_lp["logprobs"]["ranks"] == [1, 3] and "prompt_logprobs" not in with_lp


def _chunk(**lp) -> bytes:
    body = {"token_ids": [5], "logprobs": [-0.1], "ranks": [1], "top_token_ids": [[5]], "top_logprobs": [[-0.1]]}
    return msgpack.packb({"v": 1, "type": "chunk", "request_id": "r", "index": 0, "token_ids": [5], "text": "",
                          "logprobs": {**body, **lp}})


@pytest.mark.parametrize("fields, words", [
    ({"ranks": [1, 2]}, "one entry per token"),
    ({"top_logprobs": [[-0.1, -0.2]]}, "same length"),
    ({"logprobs": ["x"]}, "'logprobs'"),
    ({"logprobs": [float("nan")]}, "'logprobs'"),
    ({"top_token_ids": [5]}, "'top_token_ids'"),
    ({"ranks": [-1]}, "'ranks'"),
    ({"extra": 1}, "'extra'"),
])
def test_bad_logprobs_records_are_named(fields, words):
    with pytest.raises(P.ProtocolError) as e:
        P.decode_reply(_chunk(**fields))
    assert e.value.code == P.ErrorCode.INVALID_MESSAGE and words in e.value.message


@pytest.mark.parametrize("body, words", [
    ({}, "exactly one of 'prompt' and 'messages'"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one"),
    ({"prompt": 5}, "'prompt'"),
    ({"prompt": "a", "add_special_tokens": 1}, "'add_special_tokens'"),
])
def test_bad_tokenize_is_named(body, words):
    with pytest.raises(P.ProtocolError) as e:
        P.decode_request(msgpack.packb({"v": 1, "type": "tokenize", "tag": "t", **body}))
    assert words in e.value.message and e.value.tag == "t"


def test_detokenize_needs_token_ids():
    with pytest.raises(P.ProtocolError) as e:
        P.decode_request(msgpack.packb({"v": 1, "type": "detokenize", "token_ids": [-1]}))
    assert "'token_ids'" in e.value.message


def test_client_core_routes_tokenize_replies_by_tag():
    core = ClientCore("tcp://x", 1.0)
    tag, data = core.open_call(P.Tokenize, prompt="Hi", messages=None, add_special_tokens=True)
    assert P.decode_request(data) == P.Tokenize(prompt="Hi", tag=tag)
    assert destination(P.TokenizeReply([1], 10, tag)) == ("reply", tag)
    core.receive(P.encode(P.TokenizeReply([1], 10, tag)), 0.0)
    assert core.take_reply(tag).token_ids == [1]
    with pytest.raises(ValueError, match="exactly one"):
        core.open_call(P.Tokenize)


def test_make_generate_carries_the_new_sampling_parameters():
    from rawinfer.sampling import SamplingParams
    msg = make_generate([1, 2], params=SamplingParams(logprobs=2, logit_bias={7: 1.5}, frequency_penalty=0.2))
    assert msg.params["logit_bias"] == {"7": 1.5} and msg.params["logprobs"] == 2
    assert SamplingParams.from_dict(msg.params).logit_bias == {7: 1.5}


CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello,"}]


def test_chat_options_travel_with_messages_only():
    """`chat_options` (how the server renders `messages`): round-trips, leaves the wire when unset, and is
    refused by name without messages, with an unknown key, or asking for both renderings at once."""
    for cls, kw in ((P.Generate, {"request_id": "r"}), (P.Tokenize, {})):
        msg = cls(messages=CHAT, chat_options={"add_generation_prompt": False, "continue_final_message": True}, **kw)
        assert P.decode_request(P.encode(msg)) == msg
        assert "chat_options" not in msgpack.unpackb(P.encode(cls(messages=CHAT, **kw)))
        with pytest.raises(ValueError, match="go with 'messages'"):
            cls(prompt="x", chat_options={"add_generation_prompt": False}, **kw)
    for bad, words in (({"add_generation_prompt": 1}, "to booleans"), ({"tools": True}, "chat_options.tools must be a list"), ({"tool": []}, "to booleans"),
                       ({"add_generation_prompt": True, "continue_final_message": True}, "set add_generation"),
                       ({"continue_final_message": True}, "set add_generation")):
        body = {"v": 1, "type": "generate", "request_id": "r", "messages": CHAT, "chat_options": bad}
        with pytest.raises(P.ProtocolError, match=words):
            P.decode_request(msgpack.packb(body))
    kw = {"v": 1, "type": "tokenize", "messages": CHAT, "chat_options": {"template_kwargs": {"enable_thinking": False}}}
    assert P.decode_request(msgpack.packb(kw)).chat_options == {"template_kwargs": {"enable_thinking": False}}
    kw["chat_options"] = {"template_kwargs": [1]}
    with pytest.raises(P.ProtocolError, match="string keys"):
        P.decode_request(msgpack.packb(kw))
    assert make_generate(messages=CHAT, chat_options={"continue_final_message": True,
                                                      "add_generation_prompt": False}).chat_options is not None
