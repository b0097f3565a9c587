"""POST /tokenize and /detokenize: the engine's own tokenizer and chat template, reached through the
protocol (answered on the server's admission thread), so counts agree with what a generate request is
charged."""

from __future__ import annotations

from rawinfer.engine.chat_messages import check_tools
from rawinfer.frontends.http.engine_link import EngineLink
from rawinfer.frontends.http.errors import invalid
from rawinfer.frontends.http.params import chat_options
from rawinfer.frontends.http.schemas import DetokenizeRequest, TokenizeRequest


async def tokenize(link: EngineLink, body: TokenizeRequest) -> dict:
    if (body.prompt is None) == (body.messages is None):
        raise invalid("prompt", "give exactly one of 'prompt' and 'messages'")
    if body.messages is not None:
        messages = [m.wire() for m in body.messages]
        try:
            tools = check_tools(body.tools)
        except ValueError as e:
            raise invalid("tools", str(e)) from None
        ids = await link.tokenize(messages=messages, prompt_param="messages", chat_options=chat_options(body, tools))
    else:
        ids = await link.tokenize(body.prompt)
    return {"count": len(ids), "max_model_len": (await link.info()).get("max_model_len"), "tokens": ids}


async def detokenize(link: EngineLink, body: DetokenizeRequest) -> dict:
    return {"prompt": await link.detokenize(body.tokens)}
