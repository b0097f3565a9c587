"""The request bodies of the HTTP API as pydantic models: OpenAI's fields with OpenAI's meanings, the
engine's own sampling fields beside them, and nothing else (an unknown field is refused by name).

Types are strict (no "1" for 1); a field left out or sent as null takes the engine's default. Values
are checked further where they become SamplingParams (params.py), so that the messages name OpenAI's
field and the engine's rule.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool | None = None


class _Sampling(_Body):
    """Fields shared by completions and chat completions."""
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # the engine's own (vLLM's names)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    priority: int | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None           # how many alternatives per token (0: only the chosen one's)
    echo: bool | None = None              # the prompt first, in the text (and in logprobs)
    suffix: str | None = None             # OpenAI's insertion mode: refused unless null
    best_of: int | None = None            # refused unless null or equal to n


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None          # log-probabilities of the generated tokens
    top_logprobs: int | None = None       # with logprobs: this many alternatives per token
    # vLLM's: the template's generation prompt (default true), or the last (assistant) message continued;
    # more variables for the template (e.g. Qwen3's enable_thinking)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
