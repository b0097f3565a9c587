"""LLM: offline batch generation over an LLMEngine, results returned in input order."""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field

from rawinfer.config import DEFAULT_MODEL
from rawinfer.engine.engine import LLMEngine, RequestRejected
from rawinfer.engine.logprobs import Logprobs
from rawinfer.engine.metrics import RequestMetrics
from rawinfer.engine.structured import GrammarError
from rawinfer.sampling import SamplingParams


@dataclass
class Completion:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    metrics: RequestMetrics | None = None
    logprobs: Logprobs | None = None   # of token_ids, when params.logprobs was set


@dataclass
class GenerationResult:
    request_id: str
    prompt: str | list[int]
    prompt_token_ids: list[int]
    outputs: list[Completion]          # n completions (index order)
    prompt_logprobs: Logprobs | None = None   # of prompt_token_ids[1:], when params.prompt_logprobs was set

    # The first completion's fields, for the common n == 1 case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def metrics(self) -> RequestMetrics | None:
        return self.outputs[0].metrics


class LLM:
    def __init__(self, model_dir: str = DEFAULT_MODEL, **engine_options):
        self._use(LLMEngine(model_dir, **engine_options))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """generate() over an engine made elsewhere (LLMEngine.random, a test's shared engine)."""
        llm = cls.__new__(cls)
        llm._use(engine)
        return llm

    def _use(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._calls = itertools.count()             # request ids never repeat between generate calls

    def chat(self, messages: list[dict] | list[list[dict]],
             params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[GenerationResult]:
        """One conversation (a list of {"role": ..., "content": ...} dicts) or a list of them, each rendered
        with the model's chat template as the server renders `messages` and answered as generate() answers a
        prompt; results in input order. continue_final_message (with add_generation_prompt=False): the last,
        assistant message is continued instead of a new turn started; chat_template_kwargs: more variables for
        the template (e.g. Qwen3's enable_thinking); tools: OpenAI's `tools`, listed by the template (read the
        calls back with engine.chat_output.parse_chat_output). ChatTemplateError if the model has no chat
        template (a base model: use generate() with the text)."""
        from rawinfer.engine.tokenizer import render_chat
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a conversation (a non-empty list of {\"role\": ..., \"content\": "
                             "...} dicts) or a list of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        return self.generate([render_chat(self.tokenizer, c, add_generation_prompt, continue_final_message,
                                          chat_template_kwargs, tools=tools) for c in conversations], params,
                             use_tqdm)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[GenerationResult]:
        """Run every prompt (text or token ids) to completion; results come back in input order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; "
                             "pass one for all or one per prompt")
        _compile_grammars(self.engine, params)
        results: dict[str, GenerationResult] = {}
        order = []
        call = next(self._calls)
        bar = None
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = f"gen-{call}-{i}"
                try:
                    ids = self.engine.add_request(rid, prompt, p)
                except RequestRejected as e:
                    raise RequestRejected(f"prompt {i}: {e}") from None
                results[rid] = GenerationResult(rid, prompt, ids, [Completion(k) for k in range(p.n)])
                order.append(rid)
            if use_tqdm:
                from tqdm import tqdm
                bar = tqdm(total=len(prompts), desc="generate", unit="req", file=sys.stderr,
                           disable=not sys.stderr.isatty())
            left = sum(len(r.outputs) for r in results.values())     # samples of this call not finished
            while left and self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.request_id not in results:    # a request added to self.engine directly
                        continue
                    c = results[out.request_id].outputs[out.index]
                    c.token_ids.extend(out.new_token_ids)
                    c.text += out.text_delta
                    if out.logprobs is not None:
                        c.logprobs = c.logprobs or Logprobs()
                        c.logprobs.extend(out.logprobs)
                    if out.prompt_logprobs is not None:
                        results[out.request_id].prompt_logprobs = out.prompt_logprobs
                    if out.finished:
                        left -= 1
                        c.finish_reason, c.metrics = out.finish_reason, out.metrics
                        if bar is not None and all(x.finish_reason for x in results[out.request_id].outputs):
                            bar.update(1)
        except BaseException:          # a refused prompt or an interruption: none of this call's requests stays
            for rid in order:
                self.engine.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[rid] for rid in order]


def _compile_grammars(engine: LLMEngine, params: list[SamplingParams]) -> None:
    """Compile every structured_outputs grammar of a call together and wait: one that does not compile is
    refused (RequestRejected naming its prompt) before any request is queued."""
    futures = []
    for i, p in enumerate(params):
        try:
            futures.append((i, engine.structured.prepare(p)))
        except GrammarError as e:
            raise RequestRejected(f"prompt {i}: {e}") from None
    for i, future in futures:
        if future is not None and future.exception() is not None:
            raise RequestRejected(f"prompt {i}: {future.exception()}")
