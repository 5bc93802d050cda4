"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Field names, defaults and ranges follow OpenAI's API reference for the
fields lmc implements (and llama.cpp's extensions ``top_k`` and ``min_p``);
fields a client may send that lmc does not act on are accepted and ignored,
as OpenAI-compatible servers do, unless acting on them would change the
answer (``n`` or ``best_of`` > 1, ``echo``, ``suffix``, a role OpenAI does
not have: refused with a 400).
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from ..sampling import MAX_DIVISOR


class _Body(BaseModel):
    # strict: a JSON value of the wrong type is a 400, never coerced ("yes" is not true, true is not 1)
    model_config = ConfigDict(extra="ignore", strict=True)


class Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, lt=1.0)
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repeat_penalty: float = Field(default=1.0, ge=1 / MAX_DIVISOR, le=MAX_DIVISOR)
    n: int = Field(default=1, ge=1, le=1)
    # OpenAI's token id (as a string) -> bias added to its logit before sampling, -100 .. 100
    logit_bias: dict[str, float] | None = None
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False   # llama.cpp's and vLLM's extension: generate max_tokens whatever comes
    # lmc's extensions, speculative decoding (llama.cpp's speculative.n_max): draft_max is the tokens drafted
    # per step at most (0: no speculation for this request; default: the server's --draft-max); by default the
    # server's drafter (--draft, --draft-layers) drafts, and lookup > 0 asks for prompt lookup instead (n-gram
    # length; 0: the server's model drafter, or none; default: the server's --lookup)
    lookup: int | None = Field(default=None, ge=0, le=64)
    draft_max: int | None = Field(default=None, ge=0, le=64)
    # llama.cpp's n_keep: with the server's --context-shift, the prompt tokens every shift keeps (default: a
    # chat's system prompt, else 0)
    n_keep: int | None = Field(default=None, ge=0)
    # structured output: OpenAI's response_format ({"type": "text" | "json_object" | "json_schema",
    # "json_schema": {"name", "schema", "strict"}}), or lmc's extensions (vLLM's guided_* in spirit):
    # a Lark grammar (llguidance's dialect) or a regex the whole output matches; one of the three
    response_format: dict[str, Any] | None = None
    grammar: str | None = None
    regex: str | None = None


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow", strict=True)   # name, tool_calls, tool_call_id ... reach the template

    #: OpenAI's roles ("developer" is its newer name for system; "function" its older tool result)
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Union[str, list[dict[str, Any]], None] = None


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False   # null, as some OpenAI clients send it: off
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None    # auto, none, required, {"type": "function", ...}
    parallel_tool_calls: bool = True


class CompletionRequest(Sampling):
    prompt: Union[str, list[str], list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    # OpenAI's legacy completions fields that would change the answer: refused unless left at their default
    best_of: int | None = Field(default=None, ge=1, le=1)
    suffix: str | None = None
    max_tokens: int | None = Field(default=16, ge=1)   # OpenAI's default for completions


class TokenizeRequest(_Body):
    content: str
    add_special: bool = False
    parse_special: bool = True


class DetokenizeRequest(_Body):
    tokens: list[int]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None
    #: with ``lmc serve --context-shift``, also ``context_shifts`` and ``shifted_tokens`` (the request's
    #: shifts and the tokens they dropped); absent without it
    model_config = ConfigDict(extra="allow")


class ErrorBody(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


FinishReason = Literal["stop", "length", "tool_calls"]


# --- responses ----------------------------------------------------------------------------------

class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobOut]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None   # OpenAI's: id, type "function", function {name, arguments}


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None   # each with its index in the reply's calls


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "lmc"
    meta: dict[str, Any] | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
