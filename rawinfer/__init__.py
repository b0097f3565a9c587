"""rawinfer: a readable LLM inference engine (paged KV cache, continuous batching, CUDA or NumPy+Numba)."""

from rawinfer.config import VERSION as __version__
from rawinfer.sampling import SamplingParams


def __getattr__(name):
    # Lazy: `import rawinfer` stays cheap (no Numba compile, no tokenizer) until the engine is used.
    if name == "LLMEngine":
        from rawinfer.engine.engine import LLMEngine
        return LLMEngine
    if name == "LLM":
        from rawinfer.engine.llm import LLM
        return LLM
    raise AttributeError(f"module 'rawinfer' has no attribute {name!r}")


__all__ = ["LLM", "LLMEngine", "SamplingParams", "__version__"]
