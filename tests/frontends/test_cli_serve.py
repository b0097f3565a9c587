"""`rawinfer serve`, `client` and `bench serve` as a user runs them: a missing server reported in about a
second, a busy endpoint refused before the model loads, an aborted stream that exits 1 saying why, the
server's log, and the benchmark's files in --output-dir with the figure's percentiles and queues."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

import pytest
import zmq

from cli_util import ROOT, Server, env, free_port, rawinfer  # noqa: E402

NO_SERVER = ("rawinfer: error: no rawinfer server answered at {addr} within 1.5 s: start one with `rawinfer serve` "
             "(it answers once its model is loaded), or check --addr\n")


@pytest.mark.parametrize("command", [["client", "hello"], ["bench", "serve", "--num-requests", "2"]])
def test_a_missing_server_is_reported_in_about_a_second(command, tmp_path):
    addr = f"tcp://127.0.0.1:{free_port()}"
    t = time.monotonic()
    r = rawinfer(*command, "--addr", addr, *(["--output-dir", str(tmp_path)] if "bench" in command else []),
                 timeout=60)
    assert time.monotonic() - t < 20                 # a Python start and a 1.5 s ping, not a 60 s timeout
    assert r.returncode == 1 and r.stderr == NO_SERVER.format(addr=addr)
    assert os.listdir(tmp_path) == []


def test_a_busy_endpoint_is_refused_before_the_model_loads(tiny_llama_dir):
    ctx = zmq.Context()
    holder = ctx.socket(zmq.ROUTER)
    holder.setsockopt(zmq.LINGER, 0)
    port = holder.bind_to_random_port("tcp://127.0.0.1")
    try:
        t = time.monotonic()
        r = rawinfer("serve", "--model", tiny_llama_dir, "--bind", f"tcp://127.0.0.1:{port}", "--device", "cpu",
                     timeout=60)
        assert time.monotonic() - t < 20
    finally:
        holder.close()
        ctx.term()
    assert r.returncode == 2
    assert r.stderr == (f"rawinfer: error: cannot bind tcp://127.0.0.1:{port}: Address already in use (is another "
                        "`rawinfer serve` running there?); choose another --bind address\n")


def test_bench_serve_then_a_stream_the_server_aborts(smollm2_dir, tmp_path):
    """One SmolLM2 server: `bench serve` into --output-dir, then a long `client` stream cut by the server's
    shutdown, which must exit 1 with one line saying so."""
    srv = Server(smollm2_dir, "--kv-cache-memory", "64MiB", "--log-interval", "0.5")
    client = None
    try:
        srv.wait_ready()
        out = tmp_path / "bench"
        r = rawinfer("bench", "serve", "--addr", srv.addr, "--num-requests", "6", "--input-len", "12",
                     "--output-len", "6", "--request-rate", "20", "--output-dir", str(out), "-q", timeout=300)
        assert r.returncode == 0, r.stderr
        files = sorted(os.listdir(out))
        assert [os.path.splitext(f)[1] for f in files] == [".json", ".png"], files
        assert all(f.startswith("serve-") for f in files)
        with open(out / files[0]) as f:
            result = json.load(f)
        assert result["completed"] == 6 and result["failed"] == 0
        from rawinfer.frontends.bench import figure
        fig = figure.draw(result)
        labels = {t.get_text().split()[0] for ax in fig.axes if ax.get_legend()
                  for t in ax.get_legend().get_texts()}
        assert {"p50", "p99", "running", "waiting"} <= labels
        titles = [ax.get_title() for ax in fig.axes]
        assert "requests in the server" in titles and "TTFT" in titles
        for ax in fig.axes[:2]:                       # histograms count whole requests and gaps
            assert all(float(t).is_integer() for t in ax.get_yticks())
        assert result["kv_transfer"] is None and not any("KV transfer" in t.get_text() for t in fig.texts)
        result["kv_transfer"] = {"remote": 3, "local": 1, "fallbacks": 0, "failed": 0, "bytes": 2e6,
                                 "mean_transfer_ms": 12.0}        # as against a disaggregated server
        assert any("KV transfer: 3 prompts remote, 1 local" in t.get_text() for t in figure.draw(result).texts)

        client = subprocess.Popen([sys.executable, "-m", "rawinfer", "client", "--addr", srv.addr, "--max-tokens",
                                   "1000", "--ignore-eos", "Write a very long story about the sea."],
                                  cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert client.stdout.read(20), client.communicate(timeout=60)[1]     # the answer is streaming
        srv.proc.terminate()                          # graceful: requests in flight end with `abort`
        _, err = client.communicate(timeout=120)
        assert client.returncode == 1, err
        last = err.strip().splitlines()[-1]
        assert last.startswith("rawinfer: error: the request was aborted after ") and last.endswith(
            " tokens, before it finished (the server shut down or stopped it)"), err
        assert srv.proc.wait(60) == 0
        log = srv.output()
        assert "serving on " + srv.addr in log and "Traceback" not in log
        per_request = [ln for ln in log.splitlines() if "TTFT" in ln and "e2e" in ln]
        assert len(per_request) >= 7, log              # six benchmark requests, its warm-up, the aborted one
        assert any("tokens/s" in ln and "KV" in ln and "waiting" in ln for ln in log.splitlines()), log
    finally:
        if client is not None and client.poll() is None:
            client.kill()
            client.wait(10)
        srv.stop()


def test_serve_refuses_a_regular_file_at_its_ipc_path_and_leaves_it(tmp_path):
    """The endpoint check before the model loads must not bind: a zmq bind would replace the file."""
    folder = tmp_path / "private"
    folder.mkdir(mode=0o700)
    target = folder / "notes.txt"
    target.write_text("keep me")
    r = subprocess.run([sys.executable, "-m", "rawinfer", "serve", "--model", "no-such-model", "--bind",
                        f"ipc://{target}"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    assert "exists and is not a socket" in r.stderr and "Traceback" not in r.stderr
    assert target.read_text() == "keep me"


def test_serve_roles_prefill_and_decode_answer_as_one_engine(smollm2_dir):
    """`rawinfer serve --role prefill` and `--role decode --prefill ADDR`: the decode instance faces the
    client, the prompt's K/V comes from the prefill instance, and the greedy answer is the colocated one."""
    prompt = "Name three rivers of Europe and say where each one flows into the sea."
    ask = ["--json", "--max-tokens", "24", "--temperature", "0", prompt]
    alone = rawinfer("generate", "--model", smollm2_dir, "--device", "cpu", "--kv-cache-memory", "64MiB", *ask)
    assert alone.returncode == 0, alone.stderr
    link = f"tcp://127.0.0.1:{free_port()}"
    log = tempfile.NamedTemporaryFile("w+", prefix="rawinfer-prefill-", suffix=".log", delete=False)
    prefill = subprocess.Popen([sys.executable, "-m", "rawinfer", "serve", "--role", "prefill", "--prefill-bind",
                                link, "--model", smollm2_dir, "--device", "cpu", "--kv-cache-memory", "64MiB"],
                               stdout=log, stderr=subprocess.STDOUT, env=env(), cwd=ROOT)

    def prefill_log() -> str:
        with open(log.name) as f:
            return f.read()

    decode = Server(smollm2_dir, "--role", "decode", "--prefill", link, "--min-remote-tokens", "1")
    try:
        decode.wait_ready()
        deadline = time.monotonic() + 120
        while "prefill instance on" not in prefill_log():
            assert prefill.poll() is None and time.monotonic() < deadline, prefill_log()
            time.sleep(0.2)
        time.sleep(2.0)                   # the decode side sends work once the prefill side answered a heartbeat
        r = rawinfer("client", "--addr", decode.addr, *ask)
        assert r.returncode == 0, r.stderr + decode.output()
        assert json.loads(r.stdout)["token_ids"] == json.loads(alone.stdout)["token_ids"]
    finally:
        decode.stop()
        prefill.terminate()
        prefill.wait(30)
    m = re.search(r"'prefills': (\d+)", prefill_log())
    assert m and int(m.group(1)) >= 1, prefill_log()
