"""The PNG of `rawinfer bench serve`: its title counts the requests a run sent (a multi-turn run's
conversations x turns), its timeline is sampled every --stats-interval, and without matplotlib (the
`bench` extra) one warning says so before the run, which then writes its JSON alone."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from cli_util import ROOT, Server, env  # noqa: E402

pytest.importorskip("matplotlib")


def _record(sent: float, turn: int | None = None, conversation: int | None = None):
    from rawinfer.frontends.bench.serve import RequestRecord
    r = RequestRecord(prompt_tokens=40, max_tokens=4, sent=sent, conversation=conversation, turn=turn)
    r.token_times = [sent + 0.1 * (k + 1) + 0.013 * k * k for k in range(4)]
    r.message_times = list(r.token_times)
    r.output_tokens, r.finished, r.finish_reason = 4, sent + 0.6, "length"
    return r


def _config(**kw) -> dict:
    base = dict(model="m", request_rate=float("inf"), num_requests=200, input_len=40, output_len=4,
                turn_input_len=8, conversations=0, turns=4, stats_interval=0.25, long_fraction=0.0)
    return base | kw


def _samples(duration: float, interval: float) -> list[dict]:
    return [{"t": t, "kv_usage": 0.1, "running": 1, "waiting": 0, "server_tokens_per_s": 5.0}
            for t in np.arange(0.0, duration, interval)]


def test_a_multi_turn_title_counts_its_conversations_turns():
    from rawinfer.frontends.bench import figure
    from rawinfer.frontends.bench.serve import summarize_run
    records = [_record(0.5 * i, turn=i // 2 + 1, conversation=i % 2) for i in range(6)]     # 2 x 3
    r = summarize_run(records, 3.5, _samples(3.5, 0.25), _config(conversations=2, turns=3))
    title = figure.draw(r)._suptitle.get_text()
    assert "2 conversations x 3 turns = 6 requests" in title and "200" not in title
    assert "turn 1 in 40 (+ 8 a turn) / out 4 tokens" in title
    plain = summarize_run(records[:5], 3.5, _samples(3.5, 0.25), _config(num_requests=5))
    assert ", 5 requests, all at once, in 40 / out 4 tokens" in figure.draw(plain)._suptitle.get_text()


@pytest.mark.parametrize("interval", [0.25, 0.5, 1.0])
def test_the_timeline_is_sampled_every_stats_interval(interval):
    from rawinfer.frontends.bench.serve import summarize_run
    records = [_record(0.3 * i) for i in range(10)]
    r = summarize_run(records, 3.5, _samples(3.5, interval), _config(stats_interval=interval))
    t = r["timeline"]["t"]
    assert np.allclose(np.diff(t), interval) and t[0] == 0.0 and t[-1] + interval >= 3.5
    per_bin = np.asarray(r["timeline"]["output_tokens_per_s"]) * interval
    assert per_bin.sum() == pytest.approx(40)                 # every token counted once


def test_without_matplotlib_one_warning_says_how_to_get_it(monkeypatch, caplog):
    from rawinfer.frontends.bench import figure
    with caplog.at_level(logging.WARNING, logger="rawinfer"):
        assert figure.available()
        assert not caplog.records
        monkeypatch.setitem(sys.modules, "matplotlib", None)   # what an import finds where it is not installed
        assert not figure.available()
    (rec,) = caplog.records
    assert "matplotlib is not installed" in rec.getMessage() and "pip install 'rawinfer[bench]'" in rec.getMessage()


NO_MATPLOTLIB = ("import sys; sys.modules['matplotlib'] = None; "
                 "from rawinfer.frontends.cli.main import main; sys.exit(main(sys.argv[1:]))")


def test_bench_serve_draws_a_multi_turn_run_and_runs_without_matplotlib(tiny_llama_dir, tmp_path):
    srv = Server(tiny_llama_dir)
    try:
        srv.wait_ready()
        out = tmp_path / "turns"
        base = [sys.executable, "-m", "rawinfer"]
        run = ["bench", "serve", "--addr", srv.addr, "--conversations", "2", "--turns", "3", "--input-len", "24",
               "--turn-input-len", "8", "--output-len", "4", "--stats-interval", "0.1", "--output-dir", str(out)]
        r = subprocess.run(base + run, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        bare = tmp_path / "bare"
        r2 = subprocess.run([sys.executable, "-c", NO_MATPLOTLIB] + run[:-1] + [str(bare)], cwd=ROOT, env=env(),
                            capture_output=True, text=True, timeout=300)
    finally:
        srv.stop()
    files = sorted(os.listdir(out))
    assert [os.path.splitext(f)[1] for f in files] == [".json", ".png"], files
    with open(out / files[0]) as f:
        result = json.load(f)
    from rawinfer.frontends.bench import figure
    assert "2 conversations x 3 turns = 6 requests" in figure.draw(result)._suptitle.get_text()
    assert np.allclose(np.diff(result["timeline"]["t"]), 0.1)
    assert r2.returncode == 0, r2.stderr
    assert [os.path.splitext(f)[1] for f in os.listdir(bare)] == [".json"]
    assert r2.stderr.count("matplotlib is not installed") == 1 and "Traceback" not in r2.stderr
    assert ".png" not in r2.stdout and "wrote " in r2.stdout                   # the JSON, alone
