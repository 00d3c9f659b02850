"""Request bodies of the OpenAI-compatible endpoints (pydantic, strict JSON types).

Fields OpenAI defines that this server cannot honour (``n > 1``, ``logprobs``, ``echo``,
``best_of > 1``, tools) are refused by name; other unknown fields are ignored, as OpenAI's
own clients send extras. ``top_k`` and ``block_size`` are extensions.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _Sampling(_Body):
    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    block_size: int | None = None  # extension: speculative block
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: Any = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Any = None
    tool_choice: Any = None
    response_format: Any = None


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
