"""OpenAI-compatible request and response models, shared by the worker and the gateway.

Only what kvrouter serves: completions and chat completions (n=1; asking for
``logprobs`` is a 400; OpenAI's penalties and ``logit_bias``, vLLM's
``repetition_penalty``), SSE streaming, ``usage`` with
``prompt_tokens_details.cached_tokens`` plus our extension
``cached_tokens_by_medium``, and the PD extension
``kv_transfer_params``, and the gateway's ``tokenized_prompt`` (the prompt's token
ids, so the worker does not tokenize it again). Unknown fields are ignored, as
OpenAI's clients send many; but a request for what would change the answer and
kvrouter does not do (tool calls, a JSON ``response_format``, vLLM's guided
decoding, a completion ``suffix``, ``best_of``) is a 400 naming the field, not a
free-text answer the client would take for one that honours it (vLLM answers
a request for tools it cannot parse the same way). Errors are OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from engine_worker.request import LOGIT_BIAS_RANGE, PENALTY_RANGE, SEED_RANGE

__all__ = [
    "CLIENT_CLOSED",
    "FIRST_TOKEN_HEADER",
    "MARK_FIRST_TOKEN_HEADER",
    "ApiError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ErrorBody",
    "ErrorResponse",
    "PromptTokensDetails",
    "Text",
    "TokenizedPrompt",
    "Usage",
    "error_body",
    "new_id",
]

#: A router's request header: answer a non-streaming request with its headers and one
#: space at its first token, then the JSON body (leading whitespace is valid JSON) when it
#: is done, so that its first byte marks the end of prefill as a stream's does (a failure
#: after the space breaks the connection). A client without it gets the plain response.
MARK_FIRST_TOKEN_HEADER = "x-kvworker-mark-first-token"
#: The response header that says the first byte was sent at the first token.
FIRST_TOKEN_HEADER = "x-kvworker-first-token"

#: The status of a request whose client closed the connection first (nginx's 499): in
#: access logs and metrics only, nobody reads the response.
CLIENT_CLOSED = 499

#: Token ids are unsigned 32-bit on the wire and in block keys (DESIGN.md); any model's
#: vocabulary is far smaller, and each server checks its own bound on top of this one.
_TOKEN_ID_END = 2**32


#: Asked for log probabilities, a client got ``"logprobs": null`` and no word why.
_NO_LOGPROBS = "log probabilities are not supported: kvrouter's workers do not return them"

#: vLLM's constrained-decoding request fields: any of them set asks for output that
#: unconstrained sampling would not give.
_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                  "structured_outputs")  # fmt: skip


def _unsupported(what: str) -> ValueError:
    return ValueError(f"{what} is not supported: kvrouter's workers sample free text")


def _unicode(v: str) -> str:
    """``v`` unless it holds a lone surrogate, which JSON's ``\\ud800`` escapes let in.

    No tokenizer, no UTF-8 encoder (a response, a Redis key) takes one: refused here,
    it is a 400 instead of an exception wherever the text first goes.
    """
    if not v.isascii():
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"text is not valid Unicode: a lone surrogate {v[exc.start]!a} at {exc.start}"
            ) from None
    return v


#: A string a request may carry: valid Unicode (see :func:`_unicode`).
Text = Annotated[str, AfterValidator(_unicode)]


def new_id(prefix: str) -> str:
    """A fresh OpenAI-style id such as ``cmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    """Unix seconds for ``created`` fields."""
    return int(time.time())


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Lenient):
    """``stream_options``: ``include_usage`` adds a final usage chunk."""

    include_usage: bool = False


class TokenizedPrompt(_Lenient):
    """``tokenized_prompt``: the prompt's token ids, computed by the sender (our gateway).

    A worker uses ``ids`` instead of tokenizing the prompt (rendering the chat) itself
    only when ``tokenizer`` equals its own tokenizer's fingerprint
    (``Tokenizer.fingerprint``: the tokenizer, its BOS/EOS tokens and chat template);
    otherwise it ignores them. The ids' bounds are checked by the worker against its
    vocabulary (a per-id check here would cost more than the tokenizing it saves).
    """

    tokenizer: Annotated[str, Field(min_length=1, max_length=64)]
    ids: Annotated[list[int], Field(min_length=1)]


_Penalty = Annotated[float, Field(ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1], allow_inf_nan=False)]
_Bias = Annotated[float, Field(ge=LOGIT_BIAS_RANGE[0], le=LOGIT_BIAS_RANGE[1], allow_inf_nan=False)]


class _SamplingFields(_Lenient):
    model: Annotated[Text, Field(min_length=1, max_length=256)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    seed: Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])] | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    stop: Text | list[Text] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=2**32)]] | None = None
    ignore_eos: bool = False
    presence_penalty: _Penalty = 0.0
    frequency_penalty: _Penalty = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 1.0
    logit_bias: dict[Text, _Bias] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    cache_salt: Annotated[Text, Field(max_length=256)] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    tokenized_prompt: TokenizedPrompt | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    @field_validator(*_GUIDED_FIELDS)
    @classmethod
    def _no_guided(cls, v: Any) -> Any:
        if v is not None:
            raise _unsupported("constrained (guided) decoding")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > 16:
            raise ValueError("at most 16 stop sequences")
        if any(not s for s in items):
            raise ValueError("stop sequences must be non-empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is not None and not all(k.isdigit() and int(k) < _TOKEN_ID_END for k in v):
            raise ValueError("logit_bias keys must be token ids (decimal strings)")
        if v is not None and len(v) > 300:  # OpenAI's own bound
            raise ValueError("at most 300 logit_bias entries")
        return v

    def stop_list(self) -> list[str]:
        """``stop`` as a list."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: Text | list[int] | list[Text] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise _unsupported("a suffix (text insertion)")
        return v

    @field_validator("best_of")
    @classmethod
    def _one_best(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError("best_of must be 1: one completion is sampled per request")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: int | None) -> int | None:
        if v is not None:
            raise ValueError(_NO_LOGPROBS)
        return v

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], str | list):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            v = v[0]
        if isinstance(v, list) and any(
            not isinstance(t, int) or not 0 <= t < _TOKEN_ID_END for t in v
        ):
            raise ValueError(f"token ids must be integers in [0, {_TOKEN_ID_END})")
        if isinstance(v, str | list) and len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v  # type: ignore[no-any-return]


class TextPart(_Lenient):
    """A text part of a message's content."""

    type: Literal["text"]
    text: Text


class ChatMessage(_Lenient):
    """One chat message."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_call_id: Text | None = None

    def text(self) -> str:
        """The content as one string."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    add_generation_prompt: bool = True
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # Declared before ``tools`` and ``functions``: their checks read it.
    tool_choice: str | dict[str, Any] | None = None
    tools: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_forced_call(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        # "none" and "auto" mean nothing without tools; "required" or a named function
        # asks for a call whatever the tools.
        if v is not None and v not in ("none", "auto"):
            raise _unsupported("tool calling")
        return v

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, v: list[Any] | None, info: ValidationInfo) -> list[Any] | None:
        choice = info.data.get("tool_choice" if info.field_name == "tools" else "function_call")
        if v and choice != "none":
            raise ValueError(
                "tool calling is not supported: kvrouter's workers sample free text (with "
                f"{'tool_choice' if info.field_name == 'tools' else 'function_call'} "
                '"none" the tools are ignored)'
            )
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type", "text") != "text":
            raise _unsupported(f"response_format {v.get('type')!r} (structured output)")
        return v

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | int | None) -> bool | int | None:
        if v:
            raise ValueError(_NO_LOGPROBS)
        return v

    @model_validator(mode="after")
    def _max_tokens_alias(self) -> ChatCompletionRequest:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as plain dicts for the chat template (``developer`` becomes ``system``)."""
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]


class PromptTokensDetails(BaseModel):
    """``usage.prompt_tokens_details``."""

    cached_tokens: int = 0


class Usage(BaseModel):
    """Token counts; ``cached_tokens_by_medium`` is kvrouter's extension."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()
    cached_tokens_by_medium: dict[str, int] = Field(default_factory=dict)


class ErrorBody(BaseModel):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """``{"error": {...}}``."""

    error: ErrorBody


def error_body(
    message: str, *, type_: str = "invalid_request_error", param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """An OpenAI-style error payload as a dict."""
    return ErrorResponse(
        error=ErrorBody(message=message, type=type_, param=param, code=code)
    ).model_dump()


class ApiError(Exception):
    """An error for the client: HTTP status plus OpenAI's error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body to send."""
        return error_body(self.message, type_=self.type, param=self.param, code=self.code)
