"""The server's engine and admission threads take their first-use costs before the first request: the engine
thread repeats the warm-up's requests on itself (warmup.warm_thread) before the server answers anything,
and the admission thread compiles the chat template."""

from __future__ import annotations

import dataclasses
import threading
from types import SimpleNamespace

import pytest

from rawinfer.frontends.server import worker as W
from rawinfer.frontends.server.admission import Admission
from rawinfer.frontends.server.handoff import Outbound, Stop


class IdleEngine:
    """What EngineWorker reads of an engine that is never given a request."""

    def __init__(self, warmup: bool):
        self.config = SimpleNamespace(warmup=warmup)

    def stats(self) -> dict:
        return {}

    def has_unfinished(self) -> bool:
        return False


def run_worker(engine, monkeypatch) -> list[str]:
    """Start an EngineWorker, wait for `ready`, stop it; returns the threads warm_thread ran on."""
    seen = []
    monkeypatch.setattr(W, "warm_thread", lambda e: seen.append(threading.current_thread().name) or 0.0)
    worker = W.EngineWorker(engine, Outbound(wake=lambda: None))
    worker.start()
    assert worker.ready.wait(10)
    worker.inbox.put(Stop())
    worker.thread.join(10)
    assert not worker.thread.is_alive()
    return seen


def test_the_engine_thread_warms_itself_before_it_is_ready(monkeypatch):
    assert run_worker(IdleEngine(warmup=True), monkeypatch) == ["rawinfer-engine"]
    assert run_worker(IdleEngine(warmup=False), monkeypatch) == []      # an engine built without a warm-up


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_failed_thread_warm_up_still_releases_the_server(monkeypatch):
    """The I/O thread waits for `ready`; an engine thread that dies warming must set it, so that the server
    sees the dead thread and stops instead of waiting for ever."""
    def fail(engine):
        raise RuntimeError("no memory")
    monkeypatch.setattr(W, "warm_thread", fail)
    worker = W.EngineWorker(IdleEngine(warmup=True), Outbound(wake=lambda: None))
    worker.start()
    assert worker.ready.wait(10)
    worker.thread.join(10)
    assert not worker.thread.is_alive()


def test_the_admission_thread_compiles_the_chat_template_first(smollm2_dir):
    from rawinfer.config import ModelConfig
    from rawinfer.engine.tokenizer import ChatTemplateError, Tokenizer, render_chat
    cfg = ModelConfig.from_dir(smollm2_dir)
    tokenizer = Tokenizer.from_dir(smollm2_dir, cfg)
    assert tokenizer._template is None
    admission = Admission(SimpleNamespace(tokenizer=tokenizer), None, None, None)
    admission._warm()
    assert tokenizer._template is not None
    # a template that refuses the warm-up's conversation is left for the first real request to report
    broken = Tokenizer.from_dir(smollm2_dir, dataclasses.replace(
        cfg, chat_template="{{ raise_exception('a system message is required') }}"))
    Admission(SimpleNamespace(tokenizer=broken), None, None, None)._warm()
    with pytest.raises(ChatTemplateError, match="a system message is required"):
        render_chat(broken, [{"role": "user", "content": "Hello"}])
