"""The request bodies of the HTTP API as pydantic models: OpenAI's fields with OpenAI's meanings, the
engine's own sampling fields beside them, and the fields a body carries that none of them knows
(unknown_fields: ignored and logged, or refused under --strict-api).

Types are strict (no "1" for 1); a field left out or sent as null takes the engine's default. Values
are checked further where they become SamplingParams (params.py), so that the messages name OpenAI's
field and the engine's rule. Unknown fields are kept aside (pydantic's extra="allow") rather than
refused, as vLLM does: real clients send extras (a serving benchmark sends
`stream_options.continuous_usage_stats` with every stream, OpenAI's SDK echoes a message's `refusal`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


def unknown_fields(body: BaseModel, prefix: str = "") -> list[str]:
    """The dotted names of the fields no model knows, in `body` and in the models it holds (a list's
    entries by index: "messages.0.refusal"), in the order they were sent."""
    names = [prefix + k for k in body.model_extra or ()]
    for name in type(body).model_fields:
        value = getattr(body, name)
        if isinstance(value, BaseModel):
            names += unknown_fields(value, f"{prefix}{name}.")
        elif isinstance(value, list) and value and isinstance(value[0], BaseModel):
            for i, item in enumerate(value):
                names += unknown_fields(item, f"{prefix}{name}.{i}.")
    return names


class StreamOptions(_Body):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None      # vLLM's: the usage so far in every chunk


class JsonSchemaFormat(_Body):
    """OpenAI's response_format.json_schema: the schema the answer must follow (its name, description and
    strict flag change nothing here: the schema is always enforced)."""
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


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
    # structured output (structured.py): OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


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
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None     # an assistant's calls (checked by the engine's rules)
    tool_call_id: str | None = None                    # a tool message: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def wire(self) -> dict:
        """The message as the engine's chat template takes it: OpenAI's `developer` (the system message of
        newer models) is the templates' `system`."""
        msg = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls is not None:
            msg["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


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
    # tool calls (chat_shape.py)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None         # listed by the template, as in a chat request


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
