"""The flags of `rawinfer` as a user meets them: --version, help text for every flag with its default
stated once, -q before or after the command, and a bad value of any size or count flag answered with
one sentence and exit status 2, never a traceback."""

from __future__ import annotations

import argparse
import os
import re
import time

import pytest

from cli_util import DATA, Terminal, rawinfer  # noqa: E402


def test_version():
    from rawinfer.config import VERSION
    r = rawinfer("--version")
    assert r.returncode == 0 and r.stdout == f"rawinfer {VERSION}\n"


def _parsers():
    """(command, parser) for `rawinfer` and every command and bench under it."""
    from rawinfer.frontends.cli.main import build_parser
    todo = [("rawinfer", build_parser())]
    while todo:
        name, p = todo.pop()
        yield name, p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo += [(f"{name} {n}", sub) for n, sub in a.choices.items()]


def test_every_flag_has_help_stating_its_default_once():
    seen = 0
    for command, p in _parsers():
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                continue
            where = f"{command} {'/'.join(a.option_strings) or a.dest}"
            assert a.help and a.help.strip(), f"{where} has no help text"
            assert "%(default)" not in a.help and a.help.count("(default") <= 1, where
            if isinstance(a, argparse._StoreTrueAction) or isinstance(a, argparse._StoreFalseAction):
                assert "(default: True)" not in a.help and "(default: False)" not in a.help, where
            elif a.option_strings and a.default not in (None, [], argparse.SUPPRESS):
                assert "(default:" in a.help, f"{where}: default {a.default!r} is not stated"
            seen += 1
    assert seen > 100


def test_help_as_printed():
    r = rawinfer("generate", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert "(default: auto) (default: auto)" not in text
    assert "-q, --quiet" in text and "--top-p P sample from the smallest set" in text
    r = rawinfer("bench", "throughput", "--help")
    text = " ".join(r.stdout.split())
    assert "--no-warmup measure from the first request (default: two short requests run first, unmeasured)" \
        in text
    assert "--num-requests N requests to send (default: 64)" in text
    r = rawinfer("--help")
    assert "exit status: 0 done; 1 the run failed" in r.stdout and "chat" in r.stdout and "fetch" in r.stdout


@pytest.mark.parametrize("where", ["before", "after"])
def test_quiet_before_or_after_the_command_silences_stderr(tiny_llama_dir, where):
    args = ["generate", "5 6 7", "--token-ids", "--model", tiny_llama_dir, "--device", "cpu",
            "--kv-cache-memory", "16MiB", "--max-tokens", "4", "--ignore-eos"]
    loud = rawinfer(*args)
    assert loud.returncode == 0 and "[prompt 3 tokens | generated 4 tokens" in loud.stderr
    r = rawinfer(*(["-q"] + args if where == "before" else args + ["-q"]))
    assert r.returncode == 0, r.stderr
    assert r.stderr == "" and len(r.stdout.split()) == 4


def test_progress_on_a_terminal_and_none_with_quiet(tmp_path):
    """convert and the engine's start draw a live line on a terminal; -q draws nothing."""
    src = os.path.join(DATA, "tiny-llama")
    term = Terminal("convert", src, str(tmp_path / "a"))
    try:
        assert term.exit_status(120) == 0
    finally:
        term.kill()
    assert re.search(r"converting: +\d+%\|", term.seen), term.seen
    term = Terminal("generate", "5 6", "--token-ids", "--model", str(tmp_path / "a"), "--device", "cpu",
                    "--kv-cache-memory", "16MiB", "--max-tokens", "2")
    try:
        assert term.exit_status(120) == 0
    finally:
        term.kill()
    assert "starting the engine (loading the weights, compiling or loading the kernels) 00:0" in term.seen
    term = Terminal("-q", "convert", src, str(tmp_path / "b"))
    try:
        assert term.exit_status(120) == 0
    finally:
        term.kill()
    assert "converting:" not in term.seen and "%|" not in term.seen       # warnings still show


def _help(command: str) -> str:
    return f" (see `rawinfer {command} --help`)"


@pytest.mark.parametrize("args,message", [
    (["generate", "hi", "--block-size", "0"], "argument --block-size: must be an integer from 1 to 1024, got 0"),
    (["generate", "hi", "--max-tokens", "x"], "argument --max-tokens: 'x' is not a whole number; give a positive "
                                              "integer"),
    (["generate", "hi", "--max-num-seqs", "-3"], "argument --max-num-seqs: must be a positive integer, got -3"),
    (["generate", "hi", "--gpu-memory-utilization", "1.5"], "argument --gpu-memory-utilization: must be a number in "
                                                            "(0, 1], got 1.5"),
    (["generate", "hi", "--kv-cache-memory", "lots"], "argument --kv-cache-memory: cannot read memory size 'lots'; "
                                                      "write it like 2GiB, 512MiB or 1500000000"),
    (["generate", "hi", "--threads", "100000"], f"argument --threads: must be a positive integer up to the "
                                                f"{os.cpu_count()} CPU cores of this machine, got 100000"),
    (["serve", "--max-message-size", "0"], "argument --max-message-size: memory size must be positive, got '0'"),
    (["bench", "serve", "--request-rate", "0"], "argument --request-rate: must be a positive number, got 0"),
    (["bench", "throughput", "--range-ratio", "1"], "argument --range-ratio: must be a number in [0, 1), got 1"),
])
def test_a_bad_flag_value_is_one_sentence(args, message):
    r = rawinfer(*args)
    command = " ".join(a for a in args[:2] if a in ("generate", "serve", "bench", "throughput"))
    assert r.returncode == 2
    assert r.stderr == f"rawinfer: error: {message}{_help(command)}\n"


def test_bench_outputs_are_checked_before_the_run(tmp_path):
    """--json naming a folder failed after the whole benchmark had run, losing it; a malformed --base-url
    gave a traceback."""
    r = rawinfer("bench", "throughput", "--json", str(tmp_path))
    assert r.returncode == 2 and r.stderr == (f"rawinfer: error: {str(tmp_path)!r} is a folder: name a file for "
                                              "--json / --figure, or give --output-dir\n")
    r = rawinfer("bench", "serve", "--backend", "openai", "--base-url", "http://[::1", "--json", str(tmp_path / "x.json"))
    assert r.returncode == 1 and r.stderr.startswith("rawinfer: error: no HTTP server answered at http://[::1")


def test_sizes_the_machine_cannot_hold_are_one_sentence(tiny_llama_dir, tmp_path):
    t = time.monotonic()
    r = rawinfer("generate", "5", "--token-ids", "--model", tiny_llama_dir, "--device", "cpu",
                 "--kv-cache-memory", "100TiB")
    assert time.monotonic() - t < 60 and r.returncode == 2
    assert "Traceback" not in r.stderr and "Unable to allocate" not in r.stderr
    assert re.fullmatch(r"rawinfer: error: the memory pool needs \d+\.\d GiB \(of it 102400\.0 GiB of KV cache, "
                        r"sized by --kv-cache-memory, and \d+\.\d GiB of workspace\) but this machine has \d+\.\d GiB "
                        r"of memory available; give a smaller --kv-cache-memory", r.stderr.strip().splitlines()[-1]), r.stderr
    r = rawinfer("generate", "5", "--token-ids", "--model", tiny_llama_dir, "--device", "cpu",
                 "--kv-cache-memory", "16MiB", "--max-num-batched-tokens", "300000000")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].endswith(
        "give a smaller --max-num-batched-tokens or --max-num-seqs (they size the workspace)"), r.stderr
    r = rawinfer("bench", "throughput", "--model", tiny_llama_dir, "--device", "cpu", "--kv-cache-memory", "16MiB",
                 "--input-len", "2000", "--output-len", "8", "--output-dir", str(tmp_path), "-q")
    assert r.returncode == 2
    assert r.stderr == ("rawinfer: error: prompts of up to 2000 tokens and outputs of up to 8 (--input-len, "
                        "--output-len, --range-ratio) do not fit the context of 1024 tokens; lower them\n")
    assert os.listdir(tmp_path) == []
    r = rawinfer("bench", "roofline", "--model", tiny_llama_dir, "--batch", "1000")
    assert r.returncode == 2 and r.stderr == (
        "rawinfer: error: --batch 1000 is more than --max-num-seqs 128: a decode step cannot hold it; raise "
        "--max-num-seqs or lower --batch\n")


def test_convert_messages_name_flags_and_commands(tmp_path):
    src, dst = os.path.join(DATA, "tiny-llama"), str(tmp_path / "tiny")
    r = rawinfer("convert", src, dst)
    assert r.returncode == 0, r.stderr
    assert "`rawinfer generate --token-ids`, `rawinfer client --token-ids`" in r.stderr     # no tokenizer
    assert "list of token ids" not in r.stderr
    r = rawinfer("convert", src, dst)
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("rawinfer: error:") and "--force" in last and "overwrite" not in last
    r = rawinfer("generate", "hello", "--model", dst, "--device", "cpu", "--kv-cache-memory", "16MiB")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        f"rawinfer: error: the model in {dst} has no tokenizer, so it cannot read text: give the prompt as token "
        "ids with --token-ids, or convert it from a source that has tokenizer files")


def test_a_max_model_len_beyond_the_model_is_refused(tiny_llama_dir):
    r = rawinfer("generate", "5", "--token-ids", "--model", tiny_llama_dir, "--device", "cpu",
                 "--kv-cache-memory", "16MiB", "--max-model-len", "4096")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == ("rawinfer: error: max_model_len 4096 exceeds the model's context "
                                                 "of 1024 tokens; give --max-model-len 1024 or less"), r.stderr


def test_device_cuda_without_a_usable_gpu_is_bad_usage(tiny_llama_dir):
    from rawinfer.backend.select import cuda_usable
    if cuda_usable():
        pytest.skip("this machine has a usable GPU")
    r = rawinfer("generate", "5", "--token-ids", "--model", tiny_llama_dir, "--device", "cuda")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "--device cuda was asked for but no usable GPU was found" in r.stderr and "--device cpu" in r.stderr
