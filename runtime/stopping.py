"""When a generation ends and what text it has streamed: shared by every decoding mode.

Tokens arrive in groups (one per plain step, ``a+1`` per speculative round). The
stream turns them into text deltas, holds back any tail that could still become a stop
string, and reports where and why the request ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .tokenizer import IncrementalDetokenizer, Tokenizer


def delivered_tokens(committed: int, remaining: int) -> int:
    """A speculative round's tokens that count towards tau: those up to max_tokens (a last round
    drafts its whole block, so it may commit more than remain; tau counts what the caller got)."""
    return min(committed, remaining)


@dataclass
class Emission:
    """What one group of tokens produced: the tokens kept, the new text, and the end if any."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None


@dataclass
class TextStream:
    tokenizer: Tokenizer
    max_tokens: int
    stop: Sequence[str] = ()
    token_ids: list[int] = field(default_factory=list)
    _detok: IncrementalDetokenizer | None = None
    _text: str = ""  # all text decoded so far
    _sent: int = 0  # how much of _text has been emitted
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        self._detok = self.tokenizer.detokenizer()
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.token_ids)

    @property
    def text(self) -> str:
        return self._text[: self._sent]

    def push(self, tokens: Sequence[int]) -> Emission:
        """Take committed tokens in order; stops at EOS, a stop string or max_tokens."""
        assert self._detok is not None
        if self.finish_reason is not None:
            return Emission([], "", self.finish_reason)
        kept: list[int] = []
        for token in tokens:
            if token in self.tokenizer.eos_token_ids:
                self.finish_reason = "stop"
                break
            kept.append(token)
            self.token_ids.append(token)
            self._text += self._detok.add(token)
            if self._cut_at_stop_string():
                break
            if self.remaining <= 0:
                self.finish_reason = "length"
                break
        if self.finish_reason is not None and self.finish_reason != "stop_string":
            self._text += self._detok.finalize()
        return Emission(kept, self._release(), self._public_reason())

    def _cut_at_stop_string(self) -> bool:
        search_from = max(0, self._sent - self._hold)
        hits = [i for s in self.stop if (i := self._text.find(s, search_from)) >= 0]
        if not hits:
            return False
        self._text = self._text[: min(hits)]
        self.finish_reason = "stop_string"
        return True

    def _release(self) -> str:
        """Emit all text that can no longer turn into a stop string."""
        end = len(self._text)
        if self.finish_reason is None and self._hold:
            end = max(self._sent, end - self._longest_stop_prefix_suffix())
        delta = self._text[self._sent : end]
        self._sent = end
        return delta

    def _longest_stop_prefix_suffix(self) -> int:
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self._text)), best, -1):
                if self._text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _public_reason(self) -> str | None:
        return "stop" if self.finish_reason == "stop_string" else self.finish_reason
