"""The FastAPI app: OpenAI routes, vLLM-compatible tokenizer routes, health and metrics.

    POST /v1/completions, POST /v1/chat/completions, GET /v1/models[/{id}]
    POST /tokenize, POST /detokenize, GET /tokenizer_info      (vLLM shapes, at the root)
    GET /health, GET /metrics, GET /openapi.json                (open even with --api-key)

`create_app(config)` loads the model and builds the engine at once (a bad `--model` fails
before a port is taken); the engine loop starts and stops with the app's lifespan.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from splitphase.engine.llm import LLM
from splitphase.server.chat import message_dicts
from splitphase.server.chat_completions import create_chat_completion
from splitphase.server.completions import create_completion
from splitphase.server.config import ServerConfig
from splitphase.server.errors import APIError, bad_request, install_error_handlers
from splitphase.server.logprobs import TokenText
from splitphase.server.metrics import resolve_hardware
from splitphase.server.middleware import ApiKey, BodyLimit, RequestLog
from splitphase.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from splitphase.server.sampling import check_token_ids
from splitphase.server.state import ServerState
from splitphase.training.trainer import pick_device


def create_app(config: ServerConfig, llm: LLM | None = None) -> FastAPI:
    """An app serving `config.model` (or an already built `llm`, e.g. in tests)."""
    if llm is None:
        llm = LLM(config.model, device=config.device, dtype=config.dtype,
                  engine_process=config.runs_engine_process, **config.engine_kwargs())
    device = str(llm.model.device) if llm.model is not None else str(pick_device(config.device))
    state = ServerState(config, llm, resolve_hardware(config.hardware, device))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.start()
        try:
            yield
        finally:
            state.stop()

    app = FastAPI(title="splitphase", summary="OpenAI-compatible, phase-aware LLM server",
                  lifespan=lifespan)
    app.state.splitphase = state
    install_error_handlers(app)
    # Added innermost first: the log line wraps everything, the key is checked before the body.
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    if config.api_key:
        app.add_middleware(ApiKey, key=config.api_key)
    app.add_middleware(RequestLog)
    _openai_routes(app, state)
    _tokenizer_routes(app, state)
    _ops_routes(app, state)
    return app


def _openai_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(state, body, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(state, body, request)

    def card() -> ModelCard:
        return ModelCard(id=state.config.model_id, created=state.created,
                         root=str(state.model_dir or state.config.model),
                         max_model_len=state.max_model_len)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card()])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        if model_id != state.config.model_id:
            raise APIError(404, f"model {model_id!r} is not served here", "model",
                           "model_not_found")
        return card()


def _tokenizer_routes(app: FastAPI, state: ServerState) -> None:
    # Both run on a worker thread and answer pre-serialized JSON: tokenizing 4 MB of text, or
    # serializing a million ids through FastAPI's encoder, would stall every stream for seconds.
    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: TokenizeRequest) -> Response:
        state.check_model(body.model)
        return await asyncio.to_thread(_tokenize, state, body)

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest) -> Response:
        state.check_model(body.model)
        return await asyncio.to_thread(_detokenize, state, body)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return _tokenizer_info(state)


def _tokenize(state: ServerState, body: TokenizeRequest) -> Response:
    tok = state.tokenizer
    if body.messages is not None:
        ids = state.chat.encode(message_dicts(body.messages), body.add_generation_prompt)
    elif body.prompt is not None:
        # Special-token text is parsed, as Hugging Face tokenizers do (clients look up the eos
        # id by tokenizing its text).
        bos = body.add_special_tokens and tok.bos_token_id is not None
        ids = tok.encode(body.prompt, add_bos=bos, parse_special=True)
    else:
        raise bad_request("give `prompt` (text) or `messages`", "prompt")
    strs = [TokenText(tok)(i) for i in ids] if body.return_token_strs else None
    out = TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids,
                           token_strs=strs)
    return Response(out.model_dump_json(), media_type="application/json")


def _detokenize(state: ServerState, body: DetokenizeRequest) -> Response:
    check_token_ids(body.tokens, state.tokenizer.vocab_size, "tokens")
    out = DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens,
                                                           skip_special_tokens=False))
    return Response(out.model_dump_json(), media_type="application/json")


def _tokenizer_info(state: ServerState) -> dict[str, Any]:
    tok = state.tokenizer
    text = TokenText(tok)
    bos = text(tok.bos_token_id) if tok.bos_token_id is not None else None
    eos = text(tok.eos_token_id) if tok.eos_token_id is not None else None
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": eos,
        "unk_token": None,
        "chat_template": state.chat.jinja_source(),
        "model_max_length": state.max_model_len,
        "vocab_size": tok.vocab_size,
        "added_tokens_decoder": {
            str(i): {"content": s, "special": True} for s, i in tok.special_tokens.items()
        },
    }


def _ops_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        ok, detail = state.health()
        return JSONResponse(detail, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        state.metrics.refresh(await state.stats())
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
