"""The client's socket-free core: routing of what arrives, when a stream is over, abandoned requests and calls,
and the silence rule. Messages are fed in as the server's bytes; nothing here opens a socket."""

from __future__ import annotations

import pytest

from rawinfer.frontends.server import protocol as P
from rawinfer.frontends.client.core import (ClientCore, ClientError, Completion, RequestError, ServerTimeout,
                                                   finals_expected, make_generate)


def chunk(rid: str, index: int = 0, ids=(7,)) -> bytes:
    return P.encode(P.Chunk(rid, index, list(ids), "x"))


def final(rid: str, index: int = 0, reason: str = "length") -> P.Final:
    return P.Final(rid, index, [9], "y", reason, [1, 2], P.Usage(2, 0, 2), P.Timings(0.1, 0.01, 0.2))


def open_stream(core: ClientCore, rid: str, **params) -> None:
    data = core.open_stream(make_generate([1, 2], params=params, request_id=rid))
    assert P.decode_request(data).request_id == rid


def read_all(core: ClientCore, rid: str) -> list:
    out = []
    while core.has_message(rid):
        out.append(core.next_message(rid))
    return out


def test_messages_are_routed_to_their_own_request_and_call():
    core = ClientCore("tcp://x:1", 5.0)
    open_stream(core, "a")
    open_stream(core, "b")
    tag, data = core.open_call(P.Stats)
    assert P.decode_request(data) == P.Stats(tag=tag)
    assert core.receive(chunk("b"), 1.0) == ("stream", "b")
    assert core.receive(chunk("a", ids=(3, 4)), 1.0) == ("stream", "a")
    assert core.receive(P.encode(P.StatsReply({"running": 1}, tag=tag)), 1.0) == ("reply", tag)
    assert core.receive(P.encode(final("a")), 1.0) == ("stream", "a")
    got_a, got_b = read_all(core, "a"), read_all(core, "b")
    assert [m.token_ids for m in got_a] == [[3, 4], [9]] and isinstance(got_a[1], P.Final)
    assert [m.token_ids for m in got_b] == [[7]]
    assert core.stream_over("a") and not core.stream_over("b")
    assert core.has_reply(tag) and core.take_reply(tag).stats == {"running": 1}
    assert not core.has_reply(tag)


def test_a_stream_is_over_after_one_final_per_sample():
    core = ClientCore("tcp://x:1", 5.0)
    open_stream(core, "r", n=3)
    for i in (2, 0):
        core.receive(chunk("r", i), 1.0)
        core.receive(P.encode(final("r", i)), 1.0)
    assert len(read_all(core, "r")) == 4 and not core.stream_over("r")
    core.receive(P.encode(final("r", 1, "abort")), 1.0)
    assert core.next_message("r").index == 1 and core.stream_over("r")
    assert core.close_stream("r") is None                 # over: nothing to abort


@pytest.mark.parametrize("n, want", [(1, 1), (4, 4), (0, 1), (-2, 1), ("3", 1), (True, 1), (2.0, 1)])
def test_finals_expected(n, want):
    """An n the server refuses ends the request with one error, so it counts as one message to wait for."""
    assert finals_expected({"n": n}) == want
    assert finals_expected({}) == 1


def test_an_error_ends_its_request_and_raises():
    core = ClientCore("tcp://x:1", 5.0)
    open_stream(core, "r", n=2)
    assert core.receive(P.encode(P.Error("invalid_params", "n must be >= 1", request_id="r")), 1.0) == ("stream", "r")
    with pytest.raises(RequestError) as e:
        core.next_message("r")
    assert (e.value.code, e.value.message, e.value.request_id) == ("invalid_params", "n must be >= 1", "r")
    assert core.stream_over("r") and core.close_stream("r") is None


def test_a_duplicate_id_error_leaves_the_running_request_alone(caplog):
    core = ClientCore("tcp://x:1", 5.0)
    open_stream(core, "r")
    dup = P.Error(str(P.ErrorCode.DUPLICATE_REQUEST_ID), "already in flight", request_id="r")
    assert core.receive(P.encode(dup), 1.0) is None
    assert not core.has_message("r") and not core.stream_over("r")
    assert "already in flight" in caplog.text


def test_errors_and_replies_with_a_tag_answer_that_call():
    core = ClientCore("tcp://x:1", 5.0)
    tag, _ = core.open_call(P.Ping)
    other, _ = core.open_call(P.ModelInfo)
    assert tag != other
    assert core.receive(P.encode(P.Error("invalid_message", "bad", tag=tag)), 1.0) == ("reply", tag)
    assert not core.has_reply(other)
    with pytest.raises(RequestError) as e:
        core.take_reply(tag)
    assert e.value.code == "invalid_message"


def test_abandoned_requests_are_aborted_and_their_late_messages_dropped():
    core = ClientCore("tcp://x:1", 5.0)
    open_stream(core, "r")
    core.receive(chunk("r"), 1.0)
    assert core.next_message("r").token_ids == [7]
    abort = core.close_stream("r")                        # left mid-way: the server must stop it
    assert P.decode_request(abort) == P.Abort("r")
    assert core.close_stream("r") is None                 # only once
    assert core.receive(chunk("r"), 2.0) is None
    assert core.receive(P.encode(final("r", reason="abort")), 2.0) is None
    assert core.last_heard == 2.0                         # dropped, but the server was heard
    open_stream(core, "r")                                # the id is free again
    assert not core.has_message("r")


def test_late_replies_to_abandoned_calls_are_dropped():
    core = ClientCore("tcp://x:1", 5.0)
    tag, _ = core.open_call(P.Ping)
    core.close_call(tag)                                  # e.g. the wait timed out
    assert core.receive(P.encode(P.Pong(1.0, tag=tag)), 1.0) is None
    assert not core.has_reply(tag)
    tag2, _ = core.open_call(P.Ping)
    assert tag2 != tag
    assert core.receive(P.encode(P.Pong(1.0, tag=tag2)), 1.0) == ("reply", tag2)
    assert core.receive(P.encode(P.Pong(2.0, tag=tag2)), 1.0) is None      # only the first reply counts
    assert core.take_reply(tag2).server_time == 1.0


def test_heartbeats_and_untagged_replies_go_nowhere():
    core = ClientCore("tcp://x:1", 5.0)
    open_stream(core, "r")
    for msg in (P.Heartbeat(), P.Pong(1.0), P.Error("bad_msgpack", "not msgpack")):
        assert core.receive(P.encode(msg), 3.0) is None
    assert not core.has_message("r") and core.last_heard == 3.0


def test_a_request_id_is_in_flight_once_per_client():
    core = ClientCore("tcp://x:1", 5.0)
    open_stream(core, "r")
    with pytest.raises(ValueError, match="already in flight"):
        open_stream(core, "r")


def test_unreadable_bytes_are_a_client_error():
    core = ClientCore("tcp://x:1", 5.0)
    with pytest.raises(ClientError, match="cannot read"):
        core.receive(b"\xc1", 1.0)
    assert core.last_heard == 0.0


def test_the_silence_rule():
    """A wait may last timeout_s after the later of its start and the last message from the server."""
    core = ClientCore("tcp://host:9", 2.0)
    assert core.silence_left(started=10.0, now=10.5) == pytest.approx(1.5)
    assert core.silence_left(started=10.0, now=12.5) == pytest.approx(-0.5)
    open_stream(core, "r")
    core.receive(P.encode(P.Heartbeat()), 12.0)          # any message shows the server is alive
    assert core.silence_left(started=10.0, now=12.5) == pytest.approx(1.5)
    assert core.silence_left(started=13.0, now=13.5) == pytest.approx(1.5)
    err = core.timeout_error()
    assert isinstance(err, ServerTimeout) and "tcp://host:9" in str(err) and "2 s" in str(err)


def test_completion_collects_the_finals_in_index_order():
    msgs = [P.Chunk("r", 1, [5], "a"), final("r", 1), P.Chunk("r", 0, [6], "b"), final("r", 0, "stop")]
    done = Completion.from_messages(msgs)
    assert [f.index for f in done.outputs] == [0, 1]
    assert (done.request_id, done.prompt_token_ids, done.finish_reason) == ("r", [1, 2], "stop")


def test_the_async_client_routes_a_burst_and_times_out_on_silence():
    """The AsyncClient over a hand-driven ROUTER: a burst of messages for many streams at once (read after one
    await, the rest straight from the socket) reaches each stream in order; a server that then says nothing
    makes the waiting stream raise ServerTimeout after timeout_s."""
    import asyncio
    import time

    import zmq
    import zmq.asyncio

    from rawinfer.frontends.client.client import AsyncClient

    async def main():
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        async with AsyncClient(f"tcp://127.0.0.1:{port}", timeout_s=0.5, context=ctx) as client:
            n = 40
            streams = [client.generate([1, 2], params={"max_tokens": 3}, request_id=f"r{i}") for i in range(n)]
            firsts = [asyncio.ensure_future(s.__anext__()) for s in streams]
            ident = None
            for _ in range(n):
                ident, data = await router.recv_multipart()
                assert P.decode_request(data).request_id.startswith("r")
            for step in range(3):                  # three steps' messages, sent all at once
                for i in range(n):
                    await router.send_multipart([ident, chunk(f"r{i}", ids=(step,))])
            got = [[(await f).token_ids] for f in firsts]
            for i, s in enumerate(streams):
                got[i] += [(await s.__anext__()).token_ids for _ in range(2)]
            assert got == [[[0], [1], [2]]] * n
            t0 = time.monotonic()
            with pytest.raises(ServerTimeout):
                await streams[0].__anext__()
            assert 0.4 < time.monotonic() - t0 < 3.0
            for s in streams:
                await s.aclose()
        router.close(0)
        ctx.term()
    asyncio.run(main())
