"""The decode side of a disaggregated pair says, per request and in one line, where its prompt was
prefilled: remotely (on which prefill instance) or here (and why)."""

from __future__ import annotations

import logging

from test_disagg import engines, generate, link, reqs  # noqa: F401 - the fixtures are used by name


def test_each_request_says_once_where_its_prompt_was_prefilled(link, caplog):
    servers, conn = link
    caplog.set_level(logging.INFO, logger="rawinfer")
    long, short = list(range(3, 70)), [5, 6, 7]
    got, failed = generate(servers, conn, reqs([long, short], "where"))
    assert not failed and set(got) == {"where0", "where1"}
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request where")]
    assert len([ln for ln in lines if ln.startswith("request where0 ")]) == 1, lines
    assert len([ln for ln in lines if ln.startswith("request where1 ")]) == 1, lines
    remote = next(ln for ln in lines if ln.startswith("request where0 "))
    assert remote.startswith("request where0 prefilled remotely on tcp://127.0.0.1:") and "blocks of K/V" in remote
    assert "request where1 prefills locally: fewer than 16 uncached prompt tokens" in lines
