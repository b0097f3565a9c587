"""Warm-up at engine start: afterwards no request compiles anything, and nothing of the warm-up is left."""

from __future__ import annotations

import pytest

from conftest import _convert_tiny
from rawinfer import LLMEngine, SamplingParams
from rawinfer.backend.cpu import cache as cpu_cache


def compiled() -> dict[str, int]:
    """Compiled signatures of every CPU kernel dispatcher loaded so far."""
    return {f"{d.py_func.__module__}.{d.py_func.__qualname__}": len(d.signatures) for d in cpu_cache._dispatchers()}


def workload(engine) -> None:
    """Every kind of traffic: short and long prompts, one and many sequences decoding, a mixed step,
    n > 1 samples, seeded sampling, a repetition penalty, scoring."""
    engine.add_request("one", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    engine.step()
    engine.add_request("long", list(range(3, 80)), SamplingParams(max_tokens=3, temperature=0))
    engine.add_request("longer", list(range(3, 130)), SamplingParams(max_tokens=2, temperature=0))
    for i in range(9):
        engine.add_request(f"b{i}", [9, i + 3], SamplingParams(max_tokens=5, temperature=0.8, seed=i,
                                                               repetition_penalty=1.1))
    engine.add_request("n", [4, 4, 4], SamplingParams(max_tokens=3, n=3, temperature=1.0, seed=1))
    while engine.has_unfinished():
        engine.step()
    engine.score(list(range(3, 30)), [20, 1, 1, 1, 1, 1, 1, 1])


@pytest.mark.parametrize("quant,a8", [(None, False), ("int8", False), ("int8", True), ("q4", False), ("q4", True)])
def test_after_warm_up_no_request_compiles_a_kernel(tmp_path_factory, quant, a8):
    from rawinfer.backend.cpu import a8gemm
    if a8 and not a8gemm.available():
        pytest.skip("8-bit activations need AVX2 and FMA")
    model = _convert_tiny(tmp_path_factory, "tiny-llama", quant=quant)
    engine = LLMEngine(model, device="cpu", kv_cache_memory="8MiB", max_num_batched_tokens=256, max_num_seqs=16,
                       int8_activations=a8)
    before = compiled()
    workload(engine)
    after = compiled()
    grew = {k: (before.get(k, 0), n) for k, n in after.items() if n > before.get(k, 0)}
    assert not grew, f"kernels compiled during requests after the warm-up: {grew}"


def test_warm_up_leaves_nothing_behind(tiny_llama_dir):
    engine = LLMEngine(tiny_llama_dir, device="cpu", kv_cache_memory="8MiB", max_num_batched_tokens=64)
    stats = engine.stats()
    assert stats["steps"] == 0 and stats["tokens_generated"] == 0 and stats["requests_finished"] == 0
    assert stats["kv_blocks_used"] == 0 and stats["num_preemptions"] == 0 and stats["waiting"] == 0
    bm = engine.block_manager
    assert bm.num_cached_blocks == 0 and bm.stats.queries == 0 and bm.free_block_ids() == list(range(bm.num_blocks))
    assert engine._seed_counter == 0 and engine.num_requests == 0
    cold = LLMEngine(tiny_llama_dir, device="cpu", kv_cache_memory="8MiB", max_num_batched_tokens=64, warmup=False)
    params = SamplingParams(max_tokens=12, temperature=0.9)          # unseeded: the engine's own seed sequence
    for e in (engine, cold):
        e.add_request("r", [3, 4, 5], params)
    outs = [[t for _ in range(20) for o in e.step() for t in o.new_token_ids] for e in (engine, cold)]
    assert outs[0] == outs[1]


def test_warm_thread_on_another_thread_compiles_nothing_and_leaves_nothing_behind(tiny_llama_dir):
    """A server's engine thread repeats the warm-up's requests (warmup.warm_thread) before it serves: on
    that thread nothing compiles, and afterwards the engine is as the warm-up left it."""
    import threading

    from rawinfer.engine.warmup import warm_thread
    engine = LLMEngine(tiny_llama_dir, device="cpu", kv_cache_memory="8MiB", max_num_batched_tokens=64)
    before = compiled()
    took = []
    t = threading.Thread(target=lambda: took.append(warm_thread(engine)))
    t.start()
    t.join(120)
    assert len(took) == 1 and took[0] > 0
    assert compiled() == before
    stats = engine.stats()
    assert stats["steps"] == 0 and stats["tokens_generated"] == 0 and stats["requests_finished"] == 0
    bm = engine.block_manager
    assert bm.num_cached_blocks == 0 and bm.free_block_ids() == list(range(bm.num_blocks))
    assert engine._seed_counter == 0 and engine.num_requests == 0


def test_warm_up_fits_tiny_engines(tiny_llama_dir):
    """An engine whose pool, context or budget is too small for some warm-up requests still starts."""
    engine = LLMEngine(tiny_llama_dir, device="cpu", kv_cache_memory="64KiB", max_num_batched_tokens=8,
                       max_num_seqs=1, max_model_len=24, block_size=4)
    assert engine.block_manager.num_used_blocks == 0
    engine.add_request("r", [3, 4, 5], SamplingParams(max_tokens=4, temperature=0))
    while engine.has_unfinished():
        engine.step()


# ---- the compile helper (engine/compile_helper.py) --------------------------------------------------

def _run(code: str, env: dict | None = None, timeout: int = 900) -> str:
    """Run python `code` in a new process (this checkout first on its path); returns its stdout."""
    import os
    import subprocess
    import sys

    import rawinfer
    home = os.path.dirname(os.path.dirname(os.path.abspath(rawinfer.__file__)))
    done = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {home!r})\n" + code],
                          env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_merge_copies_only_the_builds_the_cache_lacks(tmp_path):
    """Two kernel folders of one source tree, each with a build of its own: merging one into the other
    gives the second a build it then loads instead of compiling, keeps its own, and adds nothing twice."""
    import os
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "kern.py").write_text("import numba\n\n@numba.njit(cache=True)\ndef twice(x):\n    return x * 2\n")

    def call(root, value) -> tuple[int, int]:
        out = _run(f"import sys; sys.path.insert(0, {str(pkg)!r})\n"
                   f"from rawinfer.backend.cpu import cache\ncache.install({root!r}, {str(pkg)!r})\n"
                   f"import kern\nassert kern.twice({value!r}) == 2 * {value!r}\n"
                   f"s = kern.twice.stats\nprint(sum(s.cache_hits.values()), sum(s.cache_misses.values()))")
        return tuple(int(v) for v in out.split())

    from rawinfer.backend.cpu import cache as cpu_cache
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert call(a, 1) == (0, 1) and call(b, 1.5) == (0, 1) and call(b, 1) == (0, 1)   # each compiles its own
    src, dst = cpu_cache.kernel_dir(b, str(pkg)), cpu_cache.kernel_dir(a, str(pkg))
    with open(os.path.join(src, "broken.nbi"), "wb") as f:
        f.write(b"not an index")                                     # an unreadable index is skipped
    assert cpu_cache.merge(src, dst) == 1                            # the float build; a has the int one
    assert call(a, 1.5) == (1, 0) and call(a, 1) == (1, 0)          # both load now
    assert cpu_cache.merge(src, dst) == 0


def test_compile_helper_only_where_it_can_help(tiny_llama_dir):
    from types import SimpleNamespace

    from rawinfer.engine.compile_helper import why_not
    engine = LLMEngine(tiny_llama_dir, device="cpu", kv_cache_memory="8MiB", max_num_batched_tokens=256,
                       warmup=False)
    big = 1 << 40
    assert why_not(engine, cores=2, memory=big) is None or engine.backend.max_threads < 2
    assert "one core" in why_not(engine, cores=1, memory=big)
    assert "memory" in why_not(engine, cores=2, memory=1 << 20)
    moved = SimpleNamespace(backend=engine.backend, model_dir=None, pool=engine.pool)
    assert "model folder" in why_not(moved, cores=2, memory=big)
    cuda = SimpleNamespace(backend=SimpleNamespace(name="cuda"), model_dir=tiny_llama_dir, pool=engine.pool)
    assert "kernel cache" in why_not(cuda, cores=2, memory=big)
    one = LLMEngine(tiny_llama_dir, device="cpu", kv_cache_memory="8MiB", num_threads=1, warmup=False)
    assert "thread" in why_not(one, cores=2, memory=big)


def test_a_failed_or_unreleased_helper_costs_no_result(tiny_llama_dir, tmp_path, caplog):
    """A helper that cannot load the model fails and is reported; one never released exits at the end of
    its input; either way finish() takes nothing and leaves no folder behind."""
    import logging
    import os

    from rawinfer.engine.compile_helper import CompileHelper
    engine = LLMEngine(tiny_llama_dir, device="cpu", kv_cache_memory="8MiB", warmup=False)
    with caplog.at_level(logging.INFO, logger="rawinfer"):
        for model_dir, release in ((str(tmp_path), True), (tiny_llama_dir, False)):
            engine.model_dir = model_dir
            helper = CompileHelper(engine)
            helper.start()
            root = helper.root
            if release:
                helper.release()
            assert helper.finish(wait_s=120) == 0 and not os.path.exists(root)
    failed = [r.getMessage() for r in caplog.records if "compile helper failed" in r.getMessage()]
    assert len(failed) == 1 and "config.json" in failed[0], failed
    assert not [r for r in caplog.records if "still running" in r.getMessage()]


def test_a_helper_starts_where_the_engines_working_folder_is_gone(tiny_llama_dir, tmp_path, monkeypatch, caplog):
    """The helper runs in its own folder: an engine whose working folder was deleted still starts it, and
    it loads the model and exits cleanly instead of failing to start Python."""
    import logging
    import os

    from rawinfer.engine.compile_helper import CompileHelper
    engine = LLMEngine(tiny_llama_dir, device="cpu", kv_cache_memory="8MiB", warmup=False)
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    with caplog.at_level(logging.INFO, logger="rawinfer"):
        helper = CompileHelper(engine)
        helper.start()
        root = helper.root
        helper.release()
        assert helper.finish(wait_s=120) >= 0 and not os.path.exists(root)
    assert not [r for r in caplog.records if "compile helper failed" in r.getMessage()], caplog.text


def test_a_cold_warm_up_takes_the_helpers_builds(tiny_llama_dir, tmp_path):
    """In a kernel cache that lacks a kernel of the first wave (the engine compiles it and starts the
    helper) and one of the second (the attention kernel's parallel build, which the middling prompt's
    step runs): the helper builds the latter, the engine takes it into its cache and loads it instead of
    compiling it, and no folder is left."""
    import glob
    import os
    import shutil

    from rawinfer.backend.cpu.threads import available_cores
    from rawinfer.config import EngineConfig
    if available_cores() < 2:
        pytest.skip("the helper needs a second core")
    ours = cpu_cache.kernel_dir(EngineConfig().cache_dir)
    root = str(tmp_path / "cache")
    cold = cpu_cache.kernel_dir(root)
    shutil.copytree(ours, cold, ignore=shutil.ignore_patterns("*.tmp.*"))
    for name in ("kernels._rmsnorm_kernel", "attention._paged_attention_kernel_parallel"):
        for path in glob.glob(os.path.join(cold, f"{name}-*")):
            os.remove(path)
    (tmp_path / "tmp").mkdir()
    out = _run("import logging, sys\nlogging.basicConfig(stream=sys.stdout, level=logging.INFO)\n"
               "from rawinfer import LLMEngine\nfrom rawinfer.backend.cpu import attention\n"
               f"LLMEngine({tiny_llama_dir!r}, device='cpu', kv_cache_memory='8MiB', max_num_batched_tokens=256)\n"
               "s = attention.paged_attention_kernel.parallel.stats\n"
               "print('attention', sum(s.cache_hits.values()), sum(s.cache_misses.values()))",
               env={"RAWINFER_CACHE": root, "TMPDIR": str(tmp_path / "tmp")})
    assert "compiling in two processes" in out and "builds taken into the kernel cache" in out, out
    assert "attention 1 0" in out, out
    assert glob.glob(os.path.join(cold, "attention._paged_attention_kernel_parallel-*.nbi"))
    assert os.listdir(tmp_path / "tmp") == []


def test_helper_folders_of_engines_that_are_gone_are_deleted(tmp_path):
    import os
    import subprocess
    import sys

    from rawinfer.engine.compile_helper import FOLDER_PREFIX, remove_orphans
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    names = [f"{FOLDER_PREFIX}{int(gone.stdout)}-x", f"{FOLDER_PREFIX}{os.getpid()}-y", f"{FOLDER_PREFIX}z", "other"]
    for name in names:
        (tmp_path / name).mkdir()
    remove_orphans(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted(names[1:])


def test_a_merge_that_fails_in_numbas_internals_costs_no_result(tiny_llama_dir, monkeypatch, caplog):
    """merge reads Numba's cache files through private methods another Numba may lack: finish() reports
    it and takes nothing, and the warm-up compiles on its own."""
    import logging

    from rawinfer.engine.compile_helper import CompileHelper

    def broken(src, dst):
        raise AttributeError("'IndexDataCacheFile' object has no attribute '_load_index'")
    monkeypatch.setattr(cpu_cache, "merge", broken)
    helper = CompileHelper(LLMEngine(tiny_llama_dir, device="cpu", kv_cache_memory="8MiB", warmup=False))
    with caplog.at_level(logging.INFO, logger="rawinfer"):
        helper.start()
        helper.release()
        assert helper.finish(wait_s=120) == 0
    assert [r for r in caplog.records if "builds not taken" in r.getMessage() and "_load_index" in r.getMessage()]
