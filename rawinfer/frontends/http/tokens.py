"""POST /tokenize and /detokenize: the engine's own tokenizer and chat template, reached through the
protocol, so that counts agree with what a generate request would be charged."""

from __future__ import annotations

from rawinfer.frontends.http.engine_link import EngineLink
from rawinfer.frontends.http.errors import APIError
from rawinfer.frontends.http.schemas import DetokenizeRequest, TokenizeRequest


def _not_yet(what: str) -> APIError:
    return APIError(501, f"{what} is not supported by this server yet: the engine's protocol has no such request",
                    code="not_implemented")


async def tokenize(link: EngineLink, body: TokenizeRequest) -> dict:
    raise _not_yet("POST /tokenize")


async def detokenize(link: EngineLink, body: DetokenizeRequest) -> dict:
    raise _not_yet("POST /detokenize")
