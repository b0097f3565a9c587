"""The fused CUDA ops inside the whole model, for every family, on the host shim (no GPU).

Each tiny family checkpoint (Llama; Qwen2's QKV bias; Qwen3's q/k norm; Mistral's sliding window on
every layer; Gemma 3's q/k norm, sandwich norms with 1 + w, GeGLU, local and global RoPE and sliding
layers) runs through `CUDABackend` over tests/cuda_shim twice, with the fused kernels and with the
Backend defaults that run the separate ops instead: every step's logits must be equal bit for bit
(the fused kernels round exactly as the separate ones), and the greedy tokens equal the CPU backend's.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

from rawinfer import LLMEngine
from rawinfer.backend.base import Backend
from rawinfer.backend.select import get_backend
from rawinfer.config import EngineConfig

harness = pytest.importorskip("cuda_shim.harness")
if harness.compiler() is None:
    pytest.skip("no host C++ compiler for the CUDA shim", allow_module_level=True)

from conftest import _convert_tiny, _staggered_generation  # noqa: E402

FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral-swa", "tiny-gemma3"]
FUSED_OPS = ("fused_rope_kv_write", "norm_add_rmsnorm")
PROMPTS = {"a": [5, 6, 7], "b": list(range(20, 47))}   # "b" outgrows the sliding window (24)


def shim_engine(monkeypatch, model_dir, libraries, fused: bool) -> tuple[LLMEngine, list]:
    """The CUDA engine on the shim, and the list its runner appends every step's logits to."""
    from rawinfer.backend.cuda.backend import CUDABackend
    backend = CUDABackend(launcher=harness.ShimLauncher(libraries))
    if not fused:       # the base class's composition of the separate ops
        for op in FUSED_OPS:
            setattr(backend, op, types.MethodType(getattr(Backend, op), backend))
    monkeypatch.setattr("rawinfer.engine.engine.get_backend", lambda *args, **kwargs: backend)
    engine = LLMEngine(model_dir, EngineConfig(device="cuda", kv_cache_memory=2 * 1024**2, max_num_batched_tokens=16,
                                               max_num_seqs=4, max_model_len=128, itl_target_ms=0,
                                               warmup=False))
    logits, run = [], engine.runner.run

    def recording_run(plan):
        out = run(plan)
        logits.append(np.array(out.logits))
        return out
    engine.runner.run = recording_run
    return engine, logits


@pytest.mark.parametrize("name", FAMILIES)
def test_fused_ops_give_the_separate_ops_bits_in_every_family(monkeypatch, tmp_path_factory, shim_libraries, name):
    model_dir = _convert_tiny(tmp_path_factory, name)
    fused, fused_logits = shim_engine(monkeypatch, model_dir, shim_libraries, fused=True)
    assert type(fused.backend).fused_rope_kv_write is not Backend.fused_rope_kv_write
    got = _staggered_generation(fused, PROMPTS, 4)
    separate, separate_logits = shim_engine(monkeypatch, model_dir, shim_libraries, fused=False)
    assert _staggered_generation(separate, PROMPTS, 4) == got
    assert len(fused_logits) == len(separate_logits) > 4        # prompt chunks of 16 tokens, then decodes
    for a, b in zip(fused_logits, separate_logits):
        np.testing.assert_array_equal(a, b)
    monkeypatch.setattr("rawinfer.engine.engine.get_backend", get_backend)   # the real CPU backend, not the shim's
    cpu = LLMEngine(model_dir, device="cpu", kv_cache_memory="2MiB", max_num_batched_tokens=16, max_num_seqs=4,
                    max_model_len=128, warmup=False)
    assert cpu.backend.name == "cpu"
    assert _staggered_generation(cpu, PROMPTS, 4) == got
