"""Helpers of the command-line tests: running `rawinfer` as a user does, a user cache of their own, a
tiny Hugging Face folder with a tokenizer and a chat template, a server in a subprocess, and requests
sent to it at once from many clients, with one engine's greedy answers to compare them with."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from dataclasses import dataclass

from conftest import DATA, ROOT, free_port  # noqa: E402,F401 - free_port: its importers take it from here too

CHAT_TEMPLATE = os.path.join(DATA, "tokenizer", "smollm2_chat_template.jinja")


def env(**extra: str) -> dict:
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra}


def rawinfer(*args: str, stdin: str | None = None, timeout: float = 300, cwd: str = ROOT, **env_extra: str):
    """`python -m rawinfer ARGS` (what the installed script runs), its output captured as text."""
    return subprocess.run([sys.executable, "-m", "rawinfer", *args], cwd=cwd, input=stdin, capture_output=True,
                          text=True, timeout=timeout, env=env(**env_extra))


def user_cache(tmp_path) -> str:
    """An empty user cache (RAWINFER_CACHE) that shares the real one's compiled kernels, so that engines
    started with it do not compile everything again."""
    from rawinfer.config import EngineConfig
    real = os.path.join(EngineConfig().cache_dir, "kernels")
    os.makedirs(real, exist_ok=True)
    cache = os.path.join(str(tmp_path), "cache")
    os.makedirs(cache, exist_ok=True)
    os.symlink(real, os.path.join(cache, "kernels"))
    return cache


def make_chat_model(dst: str) -> str:
    """tests/data/tiny-llama (random weights, 512 ids) as a Hugging Face folder with a byte-level BPE
    tokenizer and SmolLM2's chat template: a model `rawinfer chat` can hold a conversation with."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    os.makedirs(dst, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(os.path.join(DATA, "tiny-llama", name), dst)
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    special = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(["hello there, how are you today? the capital of france is paris. "
                            "tell me more about the sea, the sky and the quick brown fox."] * 20, trainer)
    hf.save(os.path.join(dst, "tokenizer.json"))
    with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}, f)
    shutil.copy(CHAT_TEMPLATE, os.path.join(dst, "chat_template.jinja"))
    return dst




class Server:
    """`rawinfer serve` in a subprocess, its log in a file; stop() ends it whatever happens."""

    def __init__(self, model: str, *extra: str, http: bool = False, addr: str | None = None, kv: str = "16MiB",
                 **env_extra: str):
        """With http, the OpenAI API on a free port (self.base_url); else ZeroMQ only. addr: the ZeroMQ
        endpoint (default: a free loopback port); kv: --kv-cache-memory."""
        self.addr = addr or f"tcp://127.0.0.1:{free_port()}"
        self.http_port = free_port() if http else None
        self.base_url = f"http://127.0.0.1:{self.http_port}" if http else None
        web = ["--http-port", str(self.http_port)] if http else ["--no-http"]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="rawinfer-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, "-m", "rawinfer", "serve", "--model", model, "--bind",
                                      self.addr, "--device", "cpu", "--kv-cache-memory", kv, *web, *extra],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env(**env_extra), cwd=ROOT)

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def log_lines(self, text: str, at_least: int = 1, timeout_s: float = 10.0) -> list[str]:
        """The log's lines holding `text`, once at least `at_least` of them have arrived (the workers write
        through a pipe) or timeout_s has passed."""
        deadline = time.monotonic() + timeout_s
        while len(lines := [ln for ln in self.output().splitlines() if text in ln]) < at_least and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        return lines

    def wait_ready(self, timeout_s: float = 180.0, **client_kw) -> "Server":
        """Until the server answers a ping (client_kw: the Client's keys, for a Curve server)."""
        from rawinfer.server import Client, ServerTimeout
        deadline = time.monotonic() + timeout_s
        with Client(self.addr, timeout_s=1.0, **client_kw) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.output()}")
                try:
                    c.ping()
                    return self
                except ServerTimeout:
                    continue
        raise AssertionError(f"server not ready after {timeout_s} s:\n{self.output()}")

    def wait_http(self, timeout_s: float = 60.0) -> "Server":
        """Until GET /health answers 200 (the engine answers pings by then: call wait_ready first)."""
        import httpx
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"HTTP not ready after {timeout_s} s:\n{self.output()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        os.unlink(self.log.name)


class Terminal:
    """`rawinfer ARGS` on a pseudo-terminal (stdin and stdout are a terminal): what it prints, keys typed in."""

    def __init__(self, *args: str, sigint_ignored: bool = False, **env_extra: str):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:                           # the child: the pty is its controlling terminal
            os.chdir(ROOT)
            if sigint_ignored:                      # as a shell starts its background commands
                signal.signal(signal.SIGINT, signal.SIG_IGN)
            os.execve(sys.executable, [sys.executable, "-m", "rawinfer", *args], env(**env_extra))
        # a terminal of 40 x 160 characters (a new pty has 0 x 0: progress bars would draw nothing)
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
        self.seen = ""

    def read_until(self, pattern: str, timeout: float = 180) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.seen)
            if m:
                return m
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {pattern!r} after {timeout} s in:\n{self.seen}")
            if select.select([self.fd], [], [], min(left, 1.0))[0]:
                try:
                    data = os.read(self.fd, 65536)
                except OSError:                     # EIO: the child has exited
                    data = b""
                if not data:
                    raise AssertionError(f"exited before {pattern!r}:\n{self.seen}")
                self.seen += data.decode("utf-8", "replace")

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def exit_status(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if select.select([self.fd], [], [], 0.2)[0]:
                try:
                    self.seen += os.read(self.fd, 65536).decode("utf-8", "replace")
                except OSError:
                    pass
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.pid = None
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
        raise AssertionError(f"still running after {timeout} s:\n{self.seen}")

    def kill(self) -> None:
        if self.pid is not None:
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)
            os.close(self.fd)
            self.pid = None


def offline(llm, prompts, max_tokens: int) -> list[list[int]]:
    """One in-process engine's greedy tokens (end of sequence ignored) for each prompt."""
    from rawinfer import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [r.token_ids for r in llm.generate(prompts, params, use_tqdm=False)]


@dataclass
class Outcome:
    token_ids: list[int]
    finish_reason: str
    error: str | None


def run_concurrently(addr: str, prompts: list, params: dict, stream: bool = True, timeout_s: float = 60.0) -> list:
    """Every prompt as its own request at once (one client thread each): its Outcome (chunks and final
    added up), or the exception it raised."""
    from rawinfer.server import Client
    out: list = [None] * len(prompts)

    def one(i):
        try:
            with Client(addr, timeout_s=timeout_s) as c:
                ids, final = [], None
                for m in c.generate(prompts[i], params=params, stream=stream):
                    ids += m.token_ids
                    final = m
                out[i] = Outcome(ids, final.finish_reason, final.error)
        except Exception as e:     # noqa: BLE001 (recorded for the test to judge)
            out[i] = e
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2.5 * timeout_s)
    return out
