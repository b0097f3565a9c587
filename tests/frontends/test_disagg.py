"""Prefill/decode disaggregation over the prefill link (frontends/disagg/): outputs equal to a colocated
engine's, and every fault ending with the request completed or failed cleanly and no block left on either
side. Prefill servers and the decode connector are pumped from the test's one thread (no timing races, and
no two engines computing at once)."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import zmq

from rawinfer import LLMEngine, SamplingParams
from rawinfer.frontends.disagg import wire
from rawinfer.frontends.disagg.connector import PEER_STATS, DecodeConfig, DecodeConnector
from rawinfer.frontends.disagg.prefill import PrefillConfig, PrefillServer

OPTS = dict(device="cpu", kv_cache_memory="4MiB", max_num_batched_tokens=256, max_num_seqs=48, warmup=False)
GREEDY = dict(temperature=0.0, ignore_eos=True)
FAST = dict(min_remote_tokens=16, heartbeat_s=0.02, peer_timeout_s=1.0, transfer_timeout_s=4.0)


class Faulty(PrefillServer):
    """A prefill server whose `kv` replies go wrong in one chosen way."""

    mode: str | None = None

    def _reply(self, ident, *frames):
        if self.mode is None or wire.decode(frames[0]).type != "kv":
            return super()._reply(ident, *frames)
        if self.mode == "drop_frame":
            frames = frames[:-1]
        elif self.mode == "dup_frame":
            frames = (*frames, frames[-1])
        elif self.mode == "dup_message":
            super()._reply(ident, *frames)
        elif self.mode == "fingerprint":
            h = wire.decode(frames[0])
            frames = (wire.encode("kv", **{**h.fields, "fingerprint": {**h.fields["fingerprint"], "weights": "f" * 32}}),
                      *frames[1:])
        elif self.mode == "silent":
            return True
        elif self.mode == "full":               # ZeroMQ's queue to the decode instance is full, for a while
            self.refusals = getattr(self, "refusals", 0) + 1
            if self.refusals <= 30:
                return None
        elif self.mode == "die":
            self.sock.close(0)
            self.dead = True
            return False
        return super()._reply(ident, *frames)


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    """(colocated, prefill A, prefill B, decode) over the same tiny model."""
    return tuple(LLMEngine(tiny_llama_dir, **OPTS) for _ in range(4))


@pytest.fixture
def link(engines):
    """A decode connector to two Faulty prefill servers (every engine emptied of cached prefixes first)."""
    colo, pa, pb, decode = engines
    for e in engines:
        e.reset_state()
    servers = [Faulty(e, PrefillConfig(bind="tcp://127.0.0.1:*")) for e in (pa, pb)]
    for s in servers:
        s.dead = False
    conn = DecodeConnector(decode, DecodeConfig(prefill=[s.endpoint for s in servers], **FAST))
    pump(servers, conn, until=lambda: len(conn.peers_up()) == 2)
    yield servers, conn
    conn.close()
    for s in servers:
        if not s.dead:
            s.close()


def pump(servers, conn, until, limit_s: float = 20.0) -> list:
    """Run the prefill servers, the connector and the decode engine in turn until `until()`; returns the
    requests the connector failed."""
    failed, end = [], time.monotonic() + limit_s
    while not until():
        assert time.monotonic() < end, "the link did not settle in time"
        for s in servers:
            if not s.dead:
                s.run_once(0)
        failed += conn.poll(0.002)
    return failed


def generate(servers, conn, requests, remote=True, limit_s: float = 20.0) -> tuple[dict, list]:
    decode = conn.engine
    out: dict[str, list[int]] = {}
    for rid, prompt, params in requests:
        decode.add_request(rid, prompt, params)
        if remote:
            conn.submit(rid)

    def done():
        for o in decode.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return not decode.has_unfinished() and not conn.num_inflight and not decode.stats()["receiving_kv"]
    failed = pump(servers, conn, done, limit_s)
    return out, failed


def colocated(engine, requests) -> dict:
    out: dict[str, list[int]] = {}
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def assert_no_leak(*engines):
    for e in engines:
        e.scheduler.check_invariants()
        s = e.stats()
        assert s["kv_blocks_used"] == 0 and s["receiving_kv"] == 0 and s["running"] == 0 and s["waiting"] == 0, s


def reqs(prompts, tag, max_tokens=5):
    return [(f"{tag}{i}", p, SamplingParams(max_tokens=max_tokens, **GREEDY)) for i, p in enumerate(prompts)]


def test_32_mixed_prompts_equal_the_colocated_engine(engines, link):
    servers, conn = link
    colo, pa, pb, decode = engines
    rng = np.random.default_rng(3)
    x, y = rng.integers(3, 500, 48).tolist(), rng.integers(3, 500, 40).tolist()

    def tail(lo, hi):
        return rng.integers(3, 500, int(rng.integers(lo, hi))).tolist()
    # phase 1: neither side holds anything; x reaches both sides' caches, y only the decode side's (local)
    phase1 = [x + tail(1, 30) for _ in range(4)] + [tail(20, 90) for _ in range(6)] + [tail(1, 15) for _ in range(3)]
    local_y = [y + tail(1, 5)]
    # phase 2: x hits both, y the decode side only; then the decode side forgets x: a prefill-side hit only
    phase2 = [x + tail(1, 30) for _ in range(4)] + [y + tail(20, 40) for _ in range(4)] + [[9] * 5, [11]]
    phase3 = [x + tail(17, 40) for _ in range(5)] + [tail(30, 60) for _ in range(4)]
    want = colocated(colo, reqs(phase1, "a") + reqs(local_y, "y") + reqs(phase2, "b") + reqs(phase3, "c"))
    got, failed = generate(servers, conn, reqs(phase1, "a"))
    got.update(generate(servers, conn, reqs(local_y, "y"), remote=False)[0])
    got.update(generate(servers, conn, reqs(phase2, "b"))[0])
    decode.block_manager.reset_prefix_cache()
    hits_before = sum(e.stats()["prefix_cache_hit_tokens"] for e in (pa, pb))
    got.update(generate(servers, conn, reqs(phase3, "c"))[0])
    assert len(want) >= 32 and got == want and not failed
    assert conn.counters["remote"] >= 16 and conn.counters["local"] >= 5 and conn.counters["fallbacks"] == 0
    assert sum(e.stats()["prefix_cache_hit_tokens"] for e in (pa, pb)) > hits_before      # prefill-side hits
    assert decode.stats()["prefix_cache_hit_tokens"] > 0
    assert all(s.counters["prefills"] > 0 for s in servers)                              # load spread over both
    assert_no_leak(pa, pb, decode)
    # what the decode side knows of each prefill instance (its stats), from the heartbeats after the run
    assert all(set(s.stats()) == set(PEER_STATS) for s in servers)       # every key the decode side keeps
    pump(servers, conn, until=lambda: [{k: p.get(k) for k in PEER_STATS} for p in conn.peer_stats()] ==
         [s.stats() for s in servers])             # a pong sent after the last K/V went out
    for p, s, e in zip(conn.peer_stats(), servers, (pa, pb)):
        assert p["addr"] == s.endpoint and p["up"] and p["sent_bytes"] == s.counters["sent_bytes"] > 0, p
        assert p["kv_blocks_used"] == 0 and p["kv_blocks_total"] == e.stats()["kv_blocks_total"], p


@pytest.mark.parametrize("mode", ["drop_frame", "dup_frame", "dup_message", "silent", "fingerprint", "die"])
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_faults_complete_or_fail_cleanly(engines, link, mode, policy):
    servers, conn = link
    colo, pa, pb, decode = engines
    conn.cfg.policy = policy
    conn.cfg.transfer_timeout_s = 0.5 if mode == "silent" else 4.0
    prompts = [list(range(40 + i, 100 + i)) for i in range(4)]
    want = colocated(colo, reqs(prompts, "f"))
    for s in servers:
        s.mode = mode
    got, failed = generate(servers, conn, reqs(prompts, "f"))
    if mode == "dup_message" or policy == "recompute":
        assert got == want and not failed
        assert conn.counters["fallbacks"] == (0 if mode == "dup_message" else 4)
    else:
        assert sorted(f.request_id for f in failed) == sorted(want) and conn.counters["failed"] == 4
        assert all(f.outputs[0].finished for f in failed)
        reason = failed[0].reason
        expect = {"drop_frame": "lost or repeated", "dup_frame": "lost or repeated", "silent": "within",
                  "fingerprint": "weights", "die": "stopped answering"}[mode]
        assert expect in reason, reason
        if mode == "fingerprint":
            assert "f" * 32 in reason and decode.kv_transfer.fingerprint.weights in reason
    assert conn.counters["stale"] >= (4 if mode == "dup_message" else 0)
    if mode == "die":
        assert conn.peers_up() == []
    assert_no_leak(pa, pb, decode)


def test_client_abort_during_transfer_frees_both_sides(engines, link):
    servers, conn = link
    _, pa, pb, decode = engines
    for rid, prompt, params in reqs([list(range(50, 120)), list(range(60, 130))], "ab"):
        decode.add_request(rid, prompt, params)
        assert conn.submit(rid)
    for s in servers:
        s.run_once(0)                   # the prompts are queued on the prefill side
    decode.abort("ab0")
    conn.abort("ab0")
    assert decode.stats()["receiving_kv"] == 1
    out, failed = generate(servers, conn, [])
    assert list(out) == ["ab1"] and not failed
    assert_no_leak(pa, pb, decode)


def test_losing_one_prefill_instance_leaves_the_other_serving(engines, link):
    servers, conn = link
    colo, pa, pb, decode = engines
    servers[0].close()
    servers[0].dead = True
    prompts = [list(range(30 + i, 90 + i)) for i in range(6)]
    want = colocated(colo, reqs(prompts, "l"))
    pump(servers, conn, until=lambda: conn.peers_up() == [servers[1].endpoint])
    got, failed = generate(servers, conn, reqs(prompts, "l"))
    assert got == want and not failed and conn.counters["remote"] == 6 and servers[1].counters["prefills"] == 6
    assert_no_leak(pb, decode)


def test_prefill_side_refuses_another_models_fingerprint(engines, link):
    servers, conn = link
    fp = dataclasses.replace(conn.fingerprint, block_size=32, kv_dtype="float16")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(servers[0].endpoint)
    sock.send(wire.encode("prefill", id="t1", prompt=list(range(80)), start_block=0, fingerprint=fp.to_dict()))
    sock.send(b"not json")
    # headers JSON cannot hold in Python (an integer of 5,000 digits, nesting past the recursion limit) once
    # stopped the whole prefill instance; a field of the wrong type came back without its transfer id
    sock.send(b'{"v": 1, "type": "prefill", "id": "t2", "prompt": [' + b"9" * 5000 + b"]}")
    sock.send(b"[" * 100000)
    sock.send(wire.encode("prefill", id="t3", prompt="not ids", start_block=0, fingerprint=servers[0].fingerprint))
    replies = []
    end = time.monotonic() + 10
    while len(replies) < 5 and time.monotonic() < end:
        servers[0].run_once(0.01)
        while sock.poll(0):
            replies.append(wire.decode(sock.recv()))
    sock.close(0)
    err = replies[0]
    assert err.type == "error" and err.fields["code"] == "fingerprint"
    assert "block_size 16 here vs 32 there" in err.fields["message"] and "float16" in err.fields["message"]
    assert [r.fields["code"] for r in replies[1:]] == ["rejected"] * 4
    assert replies[4].fields["id"] == "t3"
    with pytest.raises(wire.WireError):                  # the decode side reads headers with the same function
        wire.decode(b'{"v": 1, "type": "pong", "seq": ' + b"9" * 5000 + b"}")
    assert_no_leak(engines[1])


def test_a_burst_of_transfers_beyond_the_send_queue_waits_instead_of_being_dropped(engines, link):
    """A step that finishes more prompts than the decode instance's ZeroMQ queue holds: the rest wait in
    the prefill side's backlog (they were dropped, and their requests waited for the deadline)."""
    servers, conn = link
    colo, pa, pb, decode = engines
    for srv in servers:
        srv.mode = "full"
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 500, int(n)).tolist() for n in rng.integers(40, 90, 12)]
    want = colocated(colo, reqs(prompts, "q"))
    got, failed = generate(servers, conn, reqs(prompts, "q"))
    assert got == want and not failed
    assert conn.counters["fallbacks"] == 0 and all(s.counters["dropped"] == 0 for s in servers)
    assert all(s.refusals > 1 for s in servers)          # their backlogs were used
    assert conn.counters["remote"] >= 12
    assert_no_leak(pa, pb, decode)


def test_no_prefill_instance_up_or_bounds_reached_prefills_locally(engines, tiny_llama_dir):
    decode = engines[3]
    decode.reset_state()
    conn = DecodeConnector(decode, DecodeConfig(prefill=["tcp://127.0.0.1:9"], **FAST))   # nobody there
    decode.add_request("n", list(range(70)), SamplingParams(max_tokens=2, **GREEDY))
    assert not conn.submit("n") and conn.counters["local"] == 1
    conn.poll(0)
    conn.close()
    with pytest.raises(ValueError, match="choose one of"):
        DecodeConfig(prefill=["x"], policy="maybe").validate()
    with pytest.raises(ValueError, match="--prefill"):
        DecodeConfig().validate()
    while decode.has_unfinished():
        decode.step()
    assert_no_leak(decode)


def test_role_options_are_checked_before_the_model_loads():
    import argparse

    from rawinfer.frontends.cli.serve_roles import add_role_args, check_role_args
    from rawinfer.frontends.options import CLIError
    p = argparse.ArgumentParser()
    add_role_args(p)
    a = p.parse_args(["--role", "decode", "--prefill", "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"])
    check_role_args(a)
    assert a.prefill == ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"] and a.policy == "recompute"
    for bad, says in ((["--role", "decode"], "needs --prefill"), (["--prefill", "x"], "add --role decode")):
        with pytest.raises(CLIError, match=says):
            check_role_args(p.parse_args(bad))


def test_role_flags_come_from_the_role_configs():
    """The roles' flags are generated from DecodeConfig's and PrefillConfig's fields (settings.option): a
    flag's default is the field's, a bad value is argparse's error naming the flag, the prefill role's
    values land beside the server's own `bind` (prefill_<field>), and a config built in Python is checked
    field by field."""
    import argparse

    from rawinfer.frontends.cli.serve_roles import add_role_args
    from rawinfer.settings import options_from_args
    p = argparse.ArgumentParser()
    p.add_argument("--bind", default="tcp://127.0.0.1:5555")
    add_role_args(p)
    a = p.parse_args(["--prefill-bind", "tcp://127.0.0.1:7000", "--prefill-max-queued", "5", "--kv-transfer-timeout",
                      "2.5", "--min-remote-tokens", "0", "--prefill", "tcp://127.0.0.1:1"])
    pre = options_from_args(PrefillConfig, a, "prefill option", dest_prefix="prefill_", insecure=True)
    assert (pre.bind, pre.max_queued, pre.insecure, a.bind) == ("tcp://127.0.0.1:7000", 5, True, "tcp://127.0.0.1:5555")
    dec = options_from_args(DecodeConfig, a, "decode option")
    assert (dec.prefill, dec.transfer_timeout_s, dec.min_remote_tokens, dec.policy) == (
        ["tcp://127.0.0.1:1"], 2.5, 0, "recompute")
    defaults = p.parse_args([])
    assert (defaults.prefill_bind, defaults.prefill_max_queued) == (PrefillConfig().bind, PrefillConfig().max_queued)
    for argv in (["--prefill-max-queued", "0"], ["--kv-transfer-timeout", "-1"], ["--min-remote-tokens", "x"]):
        with pytest.raises(SystemExit):
            p.parse_args(argv)
    with pytest.raises(ValueError, match="heartbeat_s"):
        DecodeConfig(prefill=["tcp://127.0.0.1:1"], heartbeat_s=0).validate()
    with pytest.raises(ValueError, match="max_queued"):
        PrefillServer(None, PrefillConfig(max_queued=0))


def test_an_encrypted_link_serves_decode_instances_that_know_the_key_only(engines, tmp_path):
    """--curve-secret-key on the prefill side: a decode instance with its public key (--prefill-key) gets the
    colocated engine's tokens; one without it never sees the instance up, and prefills locally; a
    non-loopback bind is allowed with the key and refused without key or --insecure."""
    import zmq.auth

    from rawinfer.frontends.server.security import SecurityError
    colo, pa, _, decode = engines
    for e in engines:
        e.reset_state()
    public_file, secret_file = zmq.auth.create_certificates(str(tmp_path), "prefill")
    public, _ = zmq.auth.load_certificate(public_file)
    server = Faulty(pa, PrefillConfig(bind="tcp://127.0.0.1:*", curve_secret_key_file=secret_file))
    server.dead = False
    keyed = DecodeConnector(decode, DecodeConfig(prefill=[server.endpoint], server_key=public, **FAST))
    try:
        pump([server], keyed, until=lambda: len(keyed.peers_up()) == 1)
        prompts = [list(range(5 + i, 90 + i)) for i in range(4)]
        out, failed = generate([server], keyed, reqs(prompts, "c"))
        assert not failed and keyed.counters["remote"] == 4 and keyed.counters["bytes"] > 0
        assert out == colocated(colo, reqs(prompts, "c"))
    finally:
        keyed.close()
    stranger = DecodeConnector(decode, DecodeConfig(prefill=[server.endpoint], **FAST))    # no key: no handshake
    try:
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            server.run_once(0)
            stranger.poll(0.01)
        assert stranger.peers_up() == []
        decode.add_request("s", list(range(80)), SamplingParams(max_tokens=2, **GREEDY))
        assert not stranger.submit("s") and stranger.counters["local"] == 1
        while decode.has_unfinished():
            decode.step()
    finally:
        stranger.close()
        server.close()
    with pytest.raises(SecurityError, match="--curve-secret-key FILE"):
        PrefillServer(pa, PrefillConfig(bind="tcp://0.0.0.0:*"))
    PrefillServer(pa, PrefillConfig(bind="tcp://0.0.0.0:*", curve_secret_key_file=secret_file)).close()
    assert_no_leak(colo, pa, decode)


def test_a_prefill_step_longer_than_a_few_heartbeats_still_transfers(engines):
    """The prefill instance answers pings between engine steps; a long prompt's step (3.5 s here) must not
    make the decode side give up on it (the old 3 s silence limit did: every long prompt fell back)."""
    import threading
    colo, pa, _, decode = engines
    for e in engines:
        e.reset_state()
    server = PrefillServer(pa, PrefillConfig(bind="tcp://127.0.0.1:*"))
    real_step = pa.step

    def slow_step():
        if pa.has_unfinished():
            time.sleep(3.5)
        return real_step()
    pa.step = slow_step
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    conn = DecodeConnector(decode, DecodeConfig(prefill=[server.endpoint], min_remote_tokens=16, heartbeat_s=0.05))
    try:
        pump([], conn, until=lambda: len(conn.peers_up()) == 1)
        prompts = [list(range(30 + i, 110 + i)) for i in range(2)]
        out, failed = generate([], conn, reqs(prompts, "s"))
        assert not failed and conn.counters["remote"] == 2 and conn.counters["fallbacks"] == 0
        assert out == colocated(colo, reqs(prompts, "s"))
    finally:
        server.stop()
        thread.join(10)
        del pa.step
        conn.close()
    assert_no_leak(colo, pa, decode)


def test_a_prefill_instance_on_a_thread_of_its_own_warms_that_thread_first(engines, monkeypatch):
    """A Ray prefill actor serves on a thread other than the one that built its engine: run(warm=True) repeats
    the warm-up's requests on that thread before it takes a message, and leaves nothing of them behind."""
    import threading

    from rawinfer.frontends.disagg import prefill
    colo, pa, _, decode = engines
    for e in engines:
        e.reset_state()
    seen, real = [], prefill.warm_thread

    def recording(engine):
        seen.append(threading.current_thread().name)
        return real(engine)
    monkeypatch.setattr(prefill, "warm_thread", recording)
    monkeypatch.setattr(pa.config, "warmup", True)
    server = PrefillServer(pa, PrefillConfig(bind="tcp://127.0.0.1:*"))
    thread = threading.Thread(target=server.run, kwargs={"warm": True}, name="prefill-actor", daemon=True)
    thread.start()
    conn = DecodeConnector(decode, DecodeConfig(prefill=[server.endpoint], **FAST))
    try:
        pump([], conn, until=lambda: len(conn.peers_up()) == 1)
        assert seen == ["prefill-actor"]
        prompts = [list(range(40 + i, 100 + i)) for i in range(3)]
        out, failed = generate([], conn, reqs(prompts, "w"))
        assert not failed and conn.counters["remote"] == 3
        assert out == colocated(colo, reqs(prompts, "w"))
    finally:
        server.stop()
        thread.join(10)
        conn.close()
    assert_no_leak(colo, pa, decode)
