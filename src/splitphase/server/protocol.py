"""OpenAI-compatible request and response schemas (field names as the OpenAI API spells them).

Requests accept and ignore unknown fields (guidellm, `vllm bench serve` and lm-evaluation-harness
all send extras), and are strict about types: `"max_tokens": "5"` is a 400, not a silent 5.
Ranges are checked once, by `SamplingParams`, so the messages name the field and the range.
vLLM extensions we honour: `top_k`, `min_p`, `ignore_eos`, `stop_token_ids`,
`add_generation_prompt`; ours: `usage.timings`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Request):
    """`stream_options`: a last chunk with `choices: []` and the usage."""

    include_usage: bool | None = False


class _Sampling(_Request):
    """Fields both completion endpoints share."""

    model: str | None = None
    n: int | None = 1
    best_of: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Sampling):
    """`POST /v1/completions`: text or token-id prompts, one or a batch."""

    prompt: PromptInput
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None


class ContentPart(_Request):
    """One part of a message's content; only `text` parts are supported."""

    type: str
    text: str | None = None


class ChatMessage(_Request):
    """One chat turn."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


class TokenizeRequest(_Request):
    """`POST /tokenize` (vLLM): a prompt, or chat messages rendered by the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    """`POST /detokenize` (vLLM)."""

    model: str | None = None
    tokens: list[int]


# ---- responses ---------------------------------------------------------------------------------
class Timings(BaseModel):
    """Our `usage.timings` extension: this request's phase times in seconds (choice 0)."""

    queue_s: float | None = None
    prefill_s: float | None = None
    ttft_s: float | None = None
    decode_s: float | None = None
    tpot_s: float | None = None


class Usage(BaseModel):
    """OpenAI usage plus `timings`."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    timings: Timings | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions logprobs object."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One choice of a completion (or of one streamed chunk)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """`text_completion`: the whole answer, and also each streamed chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    """One alternative token in chat logprobs."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    """One generated token in chat logprobs, with its alternatives."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """`choices[i].logprobs` of a chat completion."""

    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    """The assistant's message."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    """`chat.completion`."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    """What one chunk adds to the message."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    """One choice of a streamed chat chunk."""

    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """`chat.completion.chunk`."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """One entry of `/v1/models`; `max_model_len` as vLLM reports it."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "splitphase"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    """`GET /v1/models`."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    """`POST /tokenize` (vLLM shape)."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    """`POST /detokenize` (vLLM shape)."""

    prompt: str
