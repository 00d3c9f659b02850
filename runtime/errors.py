"""The project's own exceptions: each message names the problem and what to do about it."""

from __future__ import annotations


class RuntimeErrorBase(Exception):
    """Base of every error this runtime raises on purpose."""


class CheckpointError(RuntimeErrorBase):
    """A checkpoint is missing, incomplete, misshaped or of an unsupported kind."""


class UnsupportedArchitectureError(CheckpointError):
    """The checkpoint's architecture is not one this runtime implements."""


class TokenizerError(RuntimeErrorBase):
    """A tokenizer could not be built, or a chat template failed to render."""


class ContextLengthError(RuntimeErrorBase):
    """A prompt (plus the tokens asked for) does not fit the model's context."""


class RequestError(RuntimeErrorBase):
    """A generation request has an invalid field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
