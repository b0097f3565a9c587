"""From an HTTP request body to engine requests: the prompts, the sampling parameters (checked here by
SamplingParams itself, so a bad value is a 400 naming OpenAI's field before the engine sees it), and the
fields the engine cannot honour yet, each refused by name instead of being ignored."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, fields

from rawinfer.sampling import SamplingParams, is_decimal_id
from rawinfer.frontends.http.chat_shape import ChatShape, Parsers, chat_shape
from rawinfer.frontends.http.errors import APIError, invalid, unsupported
from rawinfer.frontends.http.schemas import ChatCompletionRequest, CompletionRequest
from rawinfer.frontends.http.structured import constraint_of

COMPLETION_DEFAULT_MAX_TOKENS = 16      # OpenAI's default for /v1/completions

# request fields passed to SamplingParams under the same name when the request sets them
_PLAIN = ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids",
          "ignore_eos", "presence_penalty", "frequency_penalty")
# fields that are no-ops at these values, so clients that always send them are served
_NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0}


def engine_fields() -> set[str]:
    """The sampling parameters this engine's SamplingParams knows."""
    return {f.name for f in fields(SamplingParams)}


@dataclass
class Job:
    """One HTTP generation request as engine requests: one per prompt, each with `n` samples; choice
    index = prompt index * n + sample index, as OpenAI numbers them."""
    id: str
    created: int
    model: str
    chat: bool
    prompts: list[dict]              # the generate message's prompt part: {"prompt": ...} or {"messages": ...}
    params: dict                     # SamplingParams fields
    n: int
    priority: int
    stream: bool
    include_usage: bool              # a last chunk with the usage and no choices
    continuous_usage: bool           # the usage so far in every chunk (vLLM's continuous_usage_stats)
    echo: list[str] | None           # completions with echo: each prompt's text (None for token ids until prepared)
    logprobs: int | None             # alternatives per token asked for (None: no logprobs)
    prompt_ids: list[list[int]] | None = None    # with echo, each prompt's token ids (generation.prepare)
    prompt_counts: list[int] | None = None       # with continuous_usage, each prompt's length (prepare)
    default_max_tokens: int | None = None        # without max_tokens: at most this (None: what the context leaves)
    shape: ChatShape | None = None               # chats: tools, and how the answer is read back (chat_shape.py)

    @property
    def prompt_param(self) -> str:
        return "messages" if self.chat else "prompt"

    def engine_ids(self) -> list[str]:
        return [f"{self.id}-{i}" for i in range(len(self.prompts))]


def _sampling(req, max_tokens: int | None, max_tokens_name: str, known: set[str]) -> dict:
    params: dict = {}
    for name in _PLAIN:
        value = getattr(req, name)
        if value is None:
            continue
        if name not in known:
            if _NEUTRAL.get(name) == value:
                continue
            raise unsupported(name)
        params[name] = value
    if req.stop is not None:
        params["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if req.logit_bias:
        if "logit_bias" not in known:
            raise unsupported("logit_bias")
        keys = [k for k in req.logit_bias if not (is_decimal_id(k) and str(int(k)) == k)]
        if keys:                            # plain decimals only: " 5", "+5", "1_0" or "05" are no token ids
            raise invalid("logit_bias", f"'logit_bias' keys must be token ids written as strings, like \"50256\" "
                                        f"(got {keys[0][:20]!r})")
        params["logit_bias"] = dict(req.logit_bias)           # msgpack maps key by str
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    params["n"] = 1 if req.n is None else req.n
    constraint = constraint_of(req)
    if constraint is not None:
        params["structured_outputs"] = constraint
    try:
        SamplingParams.from_dict(params)
    except ValueError as e:
        text = str(e).replace("SamplingParams.", "")
        name = text.split("=", 1)[0] if "=" in text.split(" ", 1)[0] else "body"
        raise invalid(max_tokens_name if name == "max_tokens" else name, text) from None
    return params


def _logprobs(job_params: dict, count: int | None, echo: bool, known: set[str], param: str) -> None:
    """Ask the engine for `count` alternatives per generated token (and per prompt token with echo)."""
    if count is None:
        return
    if not 0 <= count <= 20:
        raise invalid(param, f"{param!r} must be an integer from 0 to 20")
    if "logprobs" not in known:
        raise unsupported(param, "logprobs")
    job_params["logprobs"] = count
    if echo:
        if "prompt_logprobs" not in known:
            raise unsupported("echo", "echo with logprobs (prompt log-probabilities)")
        job_params["prompt_logprobs"] = count


def _common(req, model: str, kind: str) -> dict:
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options", "'stream_options' is only allowed with \"stream\": true")
    if req.priority is not None and not -2**63 <= req.priority < 2**63:      # as the protocol carries it
        raise invalid("priority", "'priority' must be an integer that fits in 64 bits (lower runs earlier)")
    options = req.stream_options
    return dict(id=f"{kind}-{uuid.uuid4().hex}", created=int(time.time()), model=model,
                priority=req.priority or 0, stream=bool(req.stream),
                include_usage=bool(options and options.include_usage),
                continuous_usage=bool(options and options.continuous_usage_stats))


def completion_job(req: CompletionRequest, model: str, default_max_tokens: int | None = None) -> Job:
    """default_max_tokens: the server's (--default-max-tokens) for a request without max_tokens, instead of
    OpenAI's 16."""
    known = engine_fields()
    if req.suffix is not None:
        raise unsupported("suffix")
    n = 1 if req.n is None else req.n
    if req.best_of is not None and req.best_of != n:
        raise unsupported("best_of", "best_of other than n")
    prompts = _prompt_list(req.prompt)
    max_tokens = req.max_tokens
    if max_tokens is None and default_max_tokens is None:
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
    params = _sampling(req, max_tokens, "max_tokens", known)
    _logprobs(params, req.logprobs, bool(req.echo), known, "logprobs")
    echo = [p if isinstance(p, str) else None for p in prompts] if req.echo else None
    return Job(chat=False, prompts=[{"prompt": p} for p in prompts], params=params, n=params["n"], echo=echo,
               logprobs=req.logprobs, default_max_tokens=default_max_tokens, **_common(req, model, "cmpl"))


def _prompt_list(prompt) -> list:
    """OpenAI's four prompt shapes as a list of prompts (each a string or a list of token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise invalid("prompt", "'prompt' must not be empty")
    if isinstance(prompt[0], int):
        return [prompt]
    if any(isinstance(p, list) and not p for p in prompt):
        raise invalid("prompt", "'prompt' must not hold an empty list of token ids")
    return list(prompt)


def chat_job(req: ChatCompletionRequest, model: str, default_max_tokens: int | None = None,
             parsers: Parsers = Parsers()) -> Job:
    """default_max_tokens: the server's (--default-max-tokens) for a request without max_tokens, instead of
    OpenAI's (what the context leaves); parsers: how the server reads tool calls and reasoning back."""
    known = engine_fields()
    if not req.messages:
        raise invalid("messages", "'messages' must hold at least one message")
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise invalid("max_tokens", "give one of 'max_tokens' and 'max_completion_tokens', not both")
    name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = _sampling(req, max_tokens, name, known)
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("top_logprobs", "'top_logprobs' needs \"logprobs\": true")
    count = (req.top_logprobs or 0) if req.logprobs else None
    _logprobs(params, count, False, known, "top_logprobs" if req.top_logprobs else "logprobs")
    shape = chat_shape(req, parsers)
    if shape.grammar is not None:
        if "structured_outputs" in params:
            raise invalid("tool_choice", "a required tool call and a response format both constrain the output: "
                          "send one")
        params["structured_outputs"] = shape.grammar
    messages = [m.wire() for m in req.messages]
    prompt = {"messages": messages}
    options = chat_options(req, shape.tools)
    if options is not None:
        prompt["chat_options"] = options
    return Job(chat=True, prompts=[prompt], params=params, n=params["n"], echo=None, logprobs=count,
               default_max_tokens=default_max_tokens, shape=shape if shape.parses else None,
               **_common(req, model, "chatcmpl"))


def chat_options(req, tools: list[dict] | None = None) -> dict | None:
    """How the engine renders the request's messages, when not the default (the generation prompt added, no
    more template variables, no tools): vLLM's add_generation_prompt, continue_final_message and
    chat_template_kwargs, checked here so that a 400 names the field, and the tools the template lists."""
    add = req.add_generation_prompt is not False
    cont = bool(req.continue_final_message)
    if add and cont:
        raise invalid("continue_final_message", "'continue_final_message' continues the last message instead of "
                      "starting a new one: send it with \"add_generation_prompt\": false")
    if cont and (not req.messages or req.messages[-1].role != "assistant"):
        raise invalid("continue_final_message", "'continue_final_message' needs the last message to be the "
                      "assistant's beginning (role \"assistant\")")
    kwargs = req.chat_template_kwargs or {}
    from rawinfer.engine.tokenizer import RESERVED_TEMPLATE_VARIABLES     # not at import: jinja2, tokenizers
    taken = [k for k in kwargs if k in RESERVED_TEMPLATE_VARIABLES]
    if taken:
        raise invalid("chat_template_kwargs", f"'chat_template_kwargs' may not set {taken[0]!r}: the server sets it "
                      "from the request")
    if add and not cont and not kwargs and not tools:
        return None
    options = {"add_generation_prompt": add, "continue_final_message": cont}
    if tools:
        options["tools"] = tools
    return {**options, "template_kwargs": dict(kwargs)} if kwargs else options


def check_model(requested: str | None, served: list[str]) -> None:
    """404 unless the request names one of the served model's names (or none)."""
    if requested is not None and requested not in served:
        also = f" (also named {', '.join(map(repr, served[1:]))})" if len(served) > 1 else ""
        raise APIError(404, f"the model {requested!r} does not exist here; this server serves {served[0]!r}{also} "
                       "(GET /v1/models)", param="model", code="model_not_found")
