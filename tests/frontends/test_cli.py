"""The `rawinfer` command line as a user runs it: generate, convert, bench throughput and roofline (their
results in --output-dir, by default the user cache), error paths; and the one-way imports of the front ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cli_util import ROOT, make_chat_model, rawinfer, user_cache  # noqa: E402




def test_generate_capital_of_france(smollm2_dir):
    r = rawinfer("generate", "What is the capital of France?", "--model", smollm2_dir, "--device", "cpu",
                 "--kv-cache-memory", "64MiB", "--max-tokens", "32")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    summary = r.stderr.strip().splitlines()[-1]
    for word in ("prompt 37 tokens", "generated", "TTFT", "mean ITL", "tokens/s"):
        assert word in summary


def test_generate_json_stop_and_stdin(smollm2_dir):
    r = rawinfer("generate", "--json", "--model", smollm2_dir, "--device", "cpu", "--kv-cache-memory", "64MiB",
                 "--max-tokens", "32", "--stop", " Paris", stdin="What is the capital of France?")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"text", "token_ids", "prompt_token_ids", "finish_reason", "ttft_s", "itl_s", "tokens_per_s"}
    assert out["finish_reason"] == "stop" and "Paris" not in out["text"]
    assert out["text"].startswith("The capital of France is")
    assert len(out["prompt_token_ids"]) == 37


def test_generate_raw_with_seed_is_reproducible(smollm2_dir):
    args = ("generate", "--raw", "--json", "Once upon a time", "--model", smollm2_dir, "--device", "cpu",
            "--kv-cache-memory", "64MiB", "--max-tokens", "12", "--temperature", "0.8", "--seed", "5",
            "--ignore-eos")
    a, b = rawinfer(*args), rawinfer(*args)
    assert a.returncode == 0, a.stderr
    assert json.loads(a.stdout)["token_ids"] == json.loads(b.stdout)["token_ids"]
    assert json.loads(a.stdout)["finish_reason"] == "length"


def test_a_model_without_a_chat_template_takes_the_prompt_as_plain_text(tmp_path):
    """A base model (a tokenizer, no chat template): generate says the prompt goes in as plain text, and
    refuses --system, which would have nowhere to go, instead of dropping it."""
    model = make_chat_model(str(tmp_path / "base"))
    os.remove(os.path.join(model, "chat_template.jinja"))
    common = ("--model", model, "--device", "cpu", "--kv-cache-memory", "4MiB", "--json", "--max-tokens", "3",
              "--ignore-eos")
    cache = user_cache(tmp_path)
    r = rawinfer("generate", "hello there", *common, RAWINFER_CACHE=cache)
    assert r.returncode == 0, r.stderr
    assert "has no chat template" in r.stderr and "plain text" in r.stderr
    raw = rawinfer("generate", "hello there", "--raw", *common, RAWINFER_CACHE=cache)
    assert json.loads(raw.stdout)["prompt_token_ids"] == json.loads(r.stdout)["prompt_token_ids"]
    assert "has no chat template" not in raw.stderr
    r = rawinfer("generate", "hello there", "--system", "Be brief.", *common, RAWINFER_CACHE=cache)
    assert r.returncode == 2 and "--system needs a chat template" in r.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("args,words", [
    (["generate", "hi", "--model", "/nonexistent/model"], ["does not exist", "rawinfer convert"]),
    (["generate", "hi", "--temperature", "-1"], ["--temperature", "greedy"]),
    (["generate", "hi", "--kv-cache-memory", "lots"], ["--kv-cache-memory", "2GiB"]),
    (["convert", "/nonexistent/src", "/tmp/rawinfer-never-written"], ["does not exist"]),
    (["generate", "hi", "--raw", "--system", "Be brief."], ["--system", "--raw skips"]),
    (["client", "1,2", "--token-ids", "--system", "Be brief."], ["--system", "--token-ids skips"]),
])
def test_bad_arguments_give_one_clear_error(args, words):
    r = rawinfer(*args)
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("rawinfer: error:") and "Traceback" not in r.stderr
    for w in words:
        assert w in last
    assert not os.path.exists("/tmp/rawinfer-never-written")


def test_convert_cli_and_bench_throughput(tmp_path):
    dst = str(tmp_path / "tiny")
    r = rawinfer("-q", "convert", os.path.join(ROOT, "tests", "data", "tiny-llama"), dst, "--dtype", "bfloat16")
    assert r.returncode == 0, r.stderr
    assert json.load(open(os.path.join(dst, "config.json")))["dtype"] == "bfloat16"
    r = rawinfer("convert", os.path.join(ROOT, "tests", "data", "tiny-llama"), dst)
    assert r.returncode == 2 and "--force" in r.stderr
    out = tmp_path / "results"
    r = rawinfer("bench", "throughput", "--model", dst, "--device", "cpu", "--kv-cache-memory", "16MiB",
                 "--num-requests", "12", "--input-len", "20", "--output-len", "8", "--range-ratio", "0.5",
                 "--compare-single", "--output-dir", str(out))
    assert r.returncode == 0, r.stderr
    files = os.listdir(out)
    assert len(files) == 1 and files[0].startswith("throughput-") and files[0].endswith(".json")
    assert f"wrote {out / files[0]}" in r.stdout
    res = json.load(open(out / files[0]))
    assert res["num_requests"] == 12 and res["output_tokens"] > 0
    for key in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "ttft_ms", "itl_ms",
                "peak_kv_usage", "prefix_cache_hit_rate", "preemptions", "speedup_vs_single_stream"):
        assert key in res
    assert "output tokens/s" in r.stdout


def test_bench_roofline_reports_both_phases(tmp_path, tiny_llama_dir):
    cache = user_cache(tmp_path)                # results go to the user cache's bench/ by default
    r = rawinfer("-q", "bench", "roofline", "--model", tiny_llama_dir,
                 "--device", "cpu", "--kv-cache-memory", "16MiB", "--prompt-len", "40", "--batch", "1",
                 "--batch", "3", "--context", "9", "--workload", "5x24/6", RAWINFER_CACHE=cache)
    assert r.returncode == 0, r.stderr
    (name,) = os.listdir(os.path.join(cache, "bench"))
    res = json.load(open(os.path.join(cache, "bench", name)))
    assert res["ceilings"]["copy_GBps"] > 0 and res["ceilings"]["gemm_GFLOPs"] > 0
    assert [(p["phase"], p["batch"]) for p in res["phases"]] == [("prefill", 1), ("decode", 1), ("decode", 3)]
    for p in res["phases"]:
        assert p["tokens_per_s"] > 0 and p["GFLOPs"] > 0 and p["bound"] in ("compute", "memory")
    assert "prefill" in r.stdout and "decode" in r.stdout
    # the whole workload: 5 prompts of 24 tokens, 6 output tokens each, against the float32 GEMM ceiling
    from rawinfer.config import ModelConfig
    from rawinfer.frontends.bench.roofline import matrix_params, workload_flops
    w = res["workload"]
    assert (w["requests"], w["prompt_len"], w["output_len"]) == (5, 24, 6)
    cfg = ModelConfig.from_dir(tiny_llama_dir)
    assert w["TFLOP"] * 1e12 == workload_flops(cfg, 5, 24, 6) > 5 * matrix_params(cfg, 6, 24 + 5)[0]
    assert w["pct_of_float32_gemm_ceiling"] == pytest.approx(100 * w["GFLOPs"] / res["ceilings"]["gemm_GFLOPs"])
    assert abs(w["output_tokens_per_s"] * w["wall_s"] - 30) < 1e-6
    assert "workload 5 x 24/6" in r.stdout and "of the float32 GEMM ceiling" in r.stdout
    from rawinfer.backend.cpu import blas
    if blas.available():                        # the report names the BLAS kernel it measured
        assert "kernel" in res["ceilings"]["blas"] and "BLAS: OpenBLAS" in r.stdout


def test_bench_roofline_int8_model_uses_the_int8_gemm_ceiling(tmp_path, tmp_path_factory):
    from conftest import _convert_tiny
    model = _convert_tiny(tmp_path_factory, "tiny-llama", quant="int8")
    out = str(tmp_path / "roofline.json")
    r = rawinfer("-q", "bench", "roofline", "--model", model, "--device", "cpu", "--kv-cache-memory", "16MiB",
                 "--prompt-len", "40", "--batch", "3", "--context", "9", "--workload", "0", "--json", out)
    assert r.returncode == 0, r.stderr
    res = json.load(open(out))
    assert "workload" not in res
    assert res["ceilings"]["int8_gemm_GOPs"] > 0 and res["compute_ceiling"] == res["ceilings"]["int8_gemm_GOPs"]
    assert "int8-weight GEMM" in r.stdout


def test_convert_q4_cli_and_its_roofline(tmp_path):
    dst = str(tmp_path / "tiny-q4")
    r = rawinfer("-q", "convert", os.path.join(ROOT, "tests", "data", "tiny-llama"), dst, "--quant", "q4")
    assert r.returncode == 0, r.stderr
    assert json.load(open(os.path.join(dst, "config.json")))["quant"] == "q4"
    out = str(tmp_path / "roofline.json")
    r = rawinfer("-q", "bench", "roofline", "--model", dst, "--device", "cpu", "--kv-cache-memory", "16MiB",
                 "--prompt-len", "40", "--batch", "1", "--context", "9", "--workload", "0", "--json", out)
    assert r.returncode == 0, r.stderr
    res = json.load(open(out))
    assert "int8_gemm_GOPs" not in res["ceilings"]
    # its products run on the q4 GEMM (every CPU): that GEMM's ceiling is the compute ceiling
    assert res["compute_ceiling"] == res["ceilings"]["q4_gemm_GOPs"] > 0 and "q4-weight GEMM" in r.stdout
    decode = [p for p in res["phases"] if p["phase"] == "decode"][0]
    # bytes per matrix parameter: q4 layers (0.625) and int8 embedding rows (1 + 4 / 64)
    from rawinfer.config import ModelConfig
    from rawinfer.frontends.bench.roofline import weight_bytes_per_param
    bpp = weight_bytes_per_param(ModelConfig.from_dir(dst), None)
    assert 0.625 < bpp < 1.0625 and decode["tokens_per_s"] > 0


def test_bench_roofline_refuses_a_malformed_workload(tiny_llama_dir):
    r = rawinfer("-q", "bench", "roofline", "--model", tiny_llama_dir, "--workload", "64x128")
    assert r.returncode != 0 and "64x128/128" in r.stderr and "Traceback" not in r.stderr
    r = rawinfer("-q", "bench", "roofline", "--model", tiny_llama_dir, "--device", "cpu", "--workload", "200x8/8")
    assert r.returncode != 0 and "--max-num-seqs" in r.stderr and "Traceback" not in r.stderr


def test_front_end_imports_run_one_way():
    # the benchmarks and the shared options import nothing from the command line (cli/ imports them)
    code = ("import sys; import rawinfer.frontends.options, rawinfer.frontends.bench.throughput, "
            "rawinfer.frontends.bench.serve, rawinfer.frontends.bench.roofline, "
            "rawinfer.frontends.bench.step_overhead; "
            "print(sorted(m for m in sys.modules if m.startswith('rawinfer.frontends.cli')))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
