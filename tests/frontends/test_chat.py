"""`rawinfer chat` as a user drives it: through its stdin (history, commands, dropped turns), through a
pseudo-terminal (Ctrl-C stops an answer, not the chat), against a running server, and its failures."""

from __future__ import annotations

import re
import time

import pytest

from cli_util import Server, Terminal, make_chat_model, rawinfer, user_cache  # noqa: E402

ENGINE = ("--device", "cpu", "--kv-cache-memory", "16MiB")
PROMPT_TOKENS = re.compile(r"\[prompt (\d+) tokens \| generated (\d+) tokens")


@pytest.fixture(scope="module")
def chat_setup(tmp_path_factory):
    """(Hugging Face folder of a tiny chat model, a user cache of its own) shared by the tests below."""
    tmp = tmp_path_factory.mktemp("chat")
    return make_chat_model(str(tmp / "tiny-chat")), user_cache(tmp)


def chat(setup, lines: list[str], *args: str, timeout: float = 300):
    src, cache = setup
    return rawinfer("chat", "--model", src, *ENGINE, *args, stdin="".join(line + "\n" for line in lines),
                    timeout=timeout, RAWINFER_CACHE=cache)


def prompts_of(stderr: str) -> list[int]:
    return [int(m.group(1)) for m in PROMPT_TOKENS.finditer(stderr)]


def test_history_is_kept_and_commands_work(chat_setup):
    r = chat(chat_setup, ["hello", "how are you", "again", "/reset", "hello", "/system Be brief.", "hello",
                          "/nonsense", "/exit", "never read"], "--max-tokens", "6", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    p = prompts_of(r.stderr)
    assert len(p) == 5                                  # nothing after /exit is answered
    assert p[0] < p[1] < p[2]                           # every message is sent with the turns before it
    assert p[3] == p[0]                                 # /reset: the same first message again
    assert p[4] != p[3]                                 # /system changed the chat, the turn before is kept
    assert "[conversation cleared]" in r.stderr
    assert "[system message set; the conversation so far is kept]" in r.stderr
    assert "[unknown command /nonsense; commands:" in r.stderr
    assert "Traceback" not in r.stderr


def test_quiet_chat_prints_answers_only(chat_setup):
    r = chat(chat_setup, ["hello"], "--max-tokens", "4", "--ignore-eos", "-q")
    assert r.returncode == 0, r.stderr
    assert r.stderr == "" and r.stdout.endswith("\n")


def test_oldest_turns_are_dropped_when_the_context_is_full(chat_setup):
    lines = [f"tell me about the sea and the sky, question {i}" for i in range(8)]
    r = chat(chat_setup, lines, "--max-model-len", "200", "--max-tokens", "24", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    p = prompts_of(r.stderr)
    assert len(p) == 8 and all(n + 24 <= 200 for n in p)
    notices = re.findall(r"\[the conversation outgrew the context of 200 tokens: dropped the oldest (\d+) turns?; "
                         r"(\d+) kept\]", r.stderr)
    assert notices, r.stderr


def test_a_message_longer_than_the_context_is_refused_and_the_chat_goes_on(chat_setup):
    r = chat(chat_setup, ["the quick brown fox " * 60, "hello"], "--max-model-len", "128", "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert "[this message does not fit the context of 128 tokens with room for an answer of --max-tokens 8" \
        in r.stderr
    assert len(prompts_of(r.stderr)) == 1               # the next message is answered


def test_model_without_chat_template_is_one_clear_error(tiny_llama_dir):
    r = rawinfer("chat", "--model", tiny_llama_dir, *ENGINE, stdin="hello\n")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        f"rawinfer: error: the model in {tiny_llama_dir} has no tokenizer, so it cannot hold a conversation; use "
        "`rawinfer generate` (with --raw or --token-ids) instead")


def test_chat_with_no_server_fails_fast():
    t = time.monotonic()
    r = rawinfer("chat", "--addr", "tcp://127.0.0.1:9", stdin="hello\n", timeout=60)
    assert time.monotonic() - t < 15            # a Python start and a 1.5 s ping, not a 60 s timeout
    assert r.returncode == 1
    assert r.stderr.strip() == ("rawinfer: error: no rawinfer server answered at tcp://127.0.0.1:9 within 1.5 s: start "
                                "one with `rawinfer serve` (it answers once its model is loaded), or check --addr")


def test_chat_against_a_server(chat_setup):
    src, cache = chat_setup
    srv = Server(src, RAWINFER_CACHE=cache)
    try:
        srv.wait_ready()
        r = rawinfer("chat", "--addr", srv.addr, "--max-tokens", "6", "--ignore-eos",
                     stdin="hello\nhow are you\n/reset\nhello\n" + "word " * 250000 + "\nhello\n")
        assert r.returncode == 0, r.stderr
        p = prompts_of(r.stderr)
        assert len(p) == 4 and p[0] < p[1] and p[2] == p[0]
        # a line over the server's 1 MiB message limit is refused with a notice; the chat goes on (it ended
        # the whole session before)
        assert "over the server's limit" in r.stderr
    finally:
        srv.stop()


# ---- a terminal: Ctrl-C --------------------------------------------------------------------------------
@pytest.mark.parametrize("sigint_ignored", [False, True])
def test_ctrl_c_stops_the_answer_not_the_chat(smollm2_dir, sigint_ignored):
    """sigint_ignored: started as a shell starts a background command (SIGINT ignored, which Python keeps):
    the chat still takes Ctrl-C at its prompt (it once ignored them there: the suite run that way failed)."""
    term = Terminal("chat", "--model", smollm2_dir, "--device", "cpu", "--kv-cache-memory", "64MiB",
                    "--max-tokens", "400", "--ignore-eos", sigint_ignored=sigint_ignored)
    try:
        term.read_until(r"> $")
        term.type("Write a long story about the sea.\n")
        term.read_until(r"story about the sea\.\r?\n\S")       # the answer has begun
        term.type("\x03")
        m = term.read_until(r"\[stopped after (\d+) tokens\]")
        assert int(m.group(1)) < 400
        term.read_until(r"> $")                                 # back at the prompt
        time.sleep(0.5)                                         # readline has taken the terminal
        term.type("\x03")
        try:
            term.read_until(r"Ctrl-C again, Ctrl-D or /exit leaves", timeout=20)
        except AssertionError:      # the select() race of the NOTE below: the next key shows it
            term.type("\x03")
            term.read_until(r"Ctrl-C again, Ctrl-D or /exit leaves")
        # NOTE: a Ctrl-C that lands before readline waits for input again is only seen at the next key (the
        # signal cannot interrupt a select() that has not started): wait for the prompt first
        term.read_until(r"> $")
        time.sleep(0.5)
        term.type("\x03")
        assert term.exit_status() == 0
        assert "Traceback" not in term.seen
    finally:
        term.kill()
