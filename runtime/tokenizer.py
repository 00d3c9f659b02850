"""Text <-> token ids for the runtime: GGUF byte-level BPE or a Hugging Face folder.

Everything heavy (BPE merging, pre-tokenization, byte-level decoding) is done by the
`tokenizers` library; this module only assembles it the way transformers would, so that
our prompt ids match the reference implementation token for token, and adds the pieces a
generation runtime needs on top: chat templates with Hugging Face's Jinja semantics and
an incremental detokenizer for streaming.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from runtime.errors import TokenizerError

# llama.cpp's token types (tokenizer.ggml.token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Hugging Face's split regexes for the byte-level tokenizers whose GGUF `tokenizer.ggml.pre`
# names one other than GPT-2's; ByteLevel's own regex is GPT-2's, so those need a Split in
# front of a regex-less ByteLevel instead.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS: dict[str, str] = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}
# Pre-tokenizer names that mean plain GPT-2 splitting, without StarCoder's digit split.
_PLAIN_GPT2_PRE = frozenset({"gpt-2", "gpt2"})

_NO_TEMPLATE_HINT = (
    "this tokenizer has no chat template; pass a plain prompt (raw text) instead of chat messages"
)


# --------------------------------------------------------------------------------------
# small conversions
# --------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """A GGUF metadata value as a Python value: mlx/numpy scalars arrive as 0-d arrays."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    return value


def _optional_int(value: Any) -> int | None:
    value = _plain(value)
    return None if value is None else int(value)


def _special_id(metadata: Mapping[str, Any], name: str, vocab_size: int) -> int | None:
    """tokenizer.ggml.<name>, checked: an id past the vocabulary would fail much later."""
    token_id = _optional_int(metadata.get(f"tokenizer.ggml.{name}"))
    if token_id is not None and not 0 <= token_id < vocab_size:
        raise TokenizerError(
            f"tokenizer.ggml.{name} is {token_id}, outside the vocabulary of {vocab_size} tokens"
        )
    return token_id


def _as_int_list(value: Any) -> list[int]:
    """An int, a list of ints or an array of them, as a list (GGUF arrays and JSON alike)."""
    value = _plain(value)
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if hasattr(value, "tolist"):
        value = value.tolist()
    return [int(v) for v in value]


def _token_content(token: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as a serialized AddedToken."""
    if isinstance(token, Mapping):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}; the file is damaged or not JSON") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} does not hold a JSON object")
    return data


# --------------------------------------------------------------------------------------
# GGUF byte-level BPE
# --------------------------------------------------------------------------------------


def _split_merges(merges: Iterable[str]) -> list[tuple[str, str]]:
    """GGUF stores merges as "left right"; tokenizers' BPE wants (left, right) pairs.

    Byte-level tokens never contain a literal space (it is spelled 'Ġ'), so the single
    space is an unambiguous separator.
    """
    pairs: list[tuple[str, str]] = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise TokenizerError(f"malformed BPE merge {merge!r} in tokenizer.ggml.merges")
        pairs.append((parts[0], parts[1]))
    return pairs


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer the GGUF's `tokenizer.ggml.pre` stands for.

    The default is SmolLM2/StarCoder's (the one Hugging Face's tokenizer.json for SmolLM2
    has): every digit on its own, then GPT-2's byte-level split.
    """
    if pre in _PLAIN_GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    split = _PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is not None:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def _gguf_added_tokens(tokens: Sequence[str], token_types: Sequence[int]) -> list[AddedToken]:
    """Control and user-defined tokens, to be matched whole in text rather than BPE-merged.

    Control tokens are special (skipped by skip_special_tokens), as in transformers' GGUF
    conversion; user-defined ones are ordinary text that merely must not be split.
    """
    added: list[AddedToken] = []
    for token, kind in zip(tokens, token_types):
        if kind == _TOKEN_TYPE_CONTROL:
            added.append(AddedToken(token, special=True, normalized=False))
        elif kind == _TOKEN_TYPE_USER_DEFINED:
            added.append(AddedToken(token, special=False, normalized=False))
    return added


def _build_gguf_backend(
    tokens: list[str], merges: list[tuple[str, str]], token_types: list[int], pre: str | None
) -> _Backend:
    vocab = {token: index for index, token in enumerate(tokens)}
    try:
        # As transformers' GGUFGPTConverter (via GPT2Converter) builds it: no byte fallback
        # (byte-level BPE covers every byte already), no unk token, and ignore_merges left
        # off, which is also what SmolLM2's own tokenizer.json says.
        model = models.BPE(
            vocab,
            merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=False,
        )
    except Exception as exc:  # tokenizers raises plain Exception for a merge naming no token
        raise TokenizerError(f"cannot build the BPE model from the GGUF vocabulary: {exc}") from exc
    backend = _Backend(model)
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    added = _gguf_added_tokens(tokens, token_types)
    special = [token for token in added if token.special]
    if special:
        backend.add_special_tokens(special)
    if len(special) != len(added):
        backend.add_tokens([token for token in added if not token.special])
    return backend


# --------------------------------------------------------------------------------------
# Hugging Face folder
# --------------------------------------------------------------------------------------


def _register_config_added_tokens(backend: _Backend, config: Mapping[str, Any]) -> None:
    """Add tokens tokenizer_config.json declares (added_tokens_decoder) that tokenizer.json lacks.

    transformers does the same when loading; normally the two files already agree.
    """
    declared = config.get("added_tokens_decoder") or {}
    missing_special: list[AddedToken] = []
    missing_plain: list[AddedToken] = []
    for entry in declared.values():
        content = _token_content(entry)
        if content is None or backend.token_to_id(content) is not None:
            continue
        special = bool(entry.get("special", False)) if isinstance(entry, Mapping) else False
        token = AddedToken(content, special=special, normalized=False)
        (missing_special if special else missing_plain).append(token)
    if missing_special:
        backend.add_special_tokens(missing_special)
    if missing_plain:
        backend.add_tokens(missing_plain)


def _folder_chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    """The folder's chat template; a standalone file wins over tokenizer_config.json.

    Newer transformers save the template to chat_template.jinja (older ones to
    chat_template.json) and read those in preference to the config entry.
    """
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    json_file = path / "chat_template.json"
    if json_file.is_file():
        return _pick_template(_read_json(json_file).get("chat_template"))
    return _pick_template(config.get("chat_template"))


def _pick_template(template: Any) -> str | None:
    """A config may hold several named templates: use the one named 'default'."""
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    raise TokenizerError(f"chat_template has unexpected type {type(template).__name__}")


def _post_processor_adds_bos(backend: _Backend, bos_token_id: int | None) -> bool:
    """Whether tokenizer.json's post-processor prepends BOS (Llama-style TemplateProcessing).

    Used when tokenizer_config.json does not say add_bos_token: we always encode without
    the post-processor and prepend BOS ourselves, so we need to know whether it would have.
    """
    if bos_token_id is None:
        return False
    with_special = backend.encode("a", add_special_tokens=True).ids
    without = backend.encode("a", add_special_tokens=False).ids
    return bool(with_special) and with_special[0] == bos_token_id and with_special != without


# --------------------------------------------------------------------------------------
# chat templates (Hugging Face semantics)
# --------------------------------------------------------------------------------------


def _raise_exception(message: str) -> None:
    """Templates call this to reject a conversation; HF raises TemplateError too."""
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes and sorts keys; HF replaces it with plain json.dumps
    # so tool schemas render as written.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: HF uses it to mark assistant text for
    training masks; when rendering a prompt it just renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as exc:
        raise TokenizerError(f"the chat template does not compile: {exc}") from exc


def _validate_messages(messages: Any) -> None:
    if not isinstance(messages, list):
        raise TokenizerError(
            f"messages must be a list of {{'role': str, 'content': str}} dicts, "
            f"got {type(messages).__name__}"
        )
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TokenizerError(
                f"messages[{index}] must be a dict with 'role' and 'content', "
                f"got {type(message).__name__}"
            )
        for field in ("role", "content"):
            if not isinstance(message.get(field), str):
                raise TokenizerError(
                    f"messages[{index}]['{field}'] must be a string, "
                    f"got {type(message.get(field)).__name__}"
                )


# --------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------


class Tokenizer:
    """Encode, decode, render chat prompts and stream text for one model's vocabulary."""

    def __init__(
        self,
        backend: _Backend,
        *,
        vocab_size: int,
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        add_bos: bool,
        chat_template: str | None,
        eos_token: str | None = None,
    ) -> None:
        self._backend = backend
        # The template's `eos_token` is the model's own EOS, which a set of ids can't name.
        self._eos_token = eos_token
        self.vocab_size: int = vocab_size
        self.bos_token_id: int | None = bos_token_id
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids)
        self.add_bos: bool = add_bos
        self.chat_template: str | None = chat_template

    # ---- construction ----------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build from `mx.load(path, return_metadata=True)[1]` of a GGUF file."""
        kind = _plain(metadata.get("tokenizer.ggml.model"))
        if kind != "gpt2":
            raise TokenizerError(
                f"GGUF tokenizer model {kind!r} is not supported; only 'gpt2' (byte-level BPE) is"
            )
        tokens = list(metadata.get("tokenizer.ggml.tokens") or [])
        if not tokens:
            raise TokenizerError("the GGUF metadata has no tokenizer.ggml.tokens")
        merges = _split_merges(metadata.get("tokenizer.ggml.merges") or [])
        token_types = _as_int_list(metadata.get("tokenizer.ggml.token_type"))
        pre = _plain(metadata.get("tokenizer.ggml.pre"))
        backend = _build_gguf_backend(tokens, merges, token_types, pre)

        bos = _special_id(metadata, "bos_token_id", len(tokens))
        eos = _special_id(metadata, "eos_token_id", len(tokens))
        add_bos = bool(_plain(metadata.get("tokenizer.ggml.add_bos_token", False)))
        return cls(
            backend,
            vocab_size=len(tokens),
            bos_token_id=bos,
            eos_token_ids=[] if eos is None else [eos],
            add_bos=add_bos and bos is not None,
            chat_template=_plain(metadata.get("tokenizer.chat_template")),
            eos_token=None if eos is None else tokens[eos],
        )

    @classmethod
    def from_folder(cls, path: Path | str) -> Tokenizer:
        """Build from a Hugging Face model folder (tokenizer.json and friends)."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(
                f"{tokenizer_file} is missing: the folder needs the fast-tokenizer file "
                "tokenizer.json (save one with transformers' tokenizer.save_pretrained, or "
                "copy it from the model's Hugging Face repository)"
            )
        try:
            backend = _Backend.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises plain Exception on a bad file
            raise TokenizerError(f"cannot load {tokenizer_file}: {exc}") from exc

        config_file = path / "tokenizer_config.json"
        config = _read_json(config_file) if config_file.is_file() else {}
        _register_config_added_tokens(backend, config)

        bos = cls._token_id(backend, _token_content(config.get("bos_token")))
        eos_token = _token_content(config.get("eos_token"))
        eos_ids = cls._folder_eos_ids(backend, path, eos_token)
        add_bos = config.get("add_bos_token")
        if not isinstance(add_bos, bool):
            add_bos = _post_processor_adds_bos(backend, bos)
        return cls(
            backend,
            vocab_size=cls._backend_vocab_size(backend),
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            add_bos=add_bos and bos is not None,
            chat_template=_folder_chat_template(path, config),
            eos_token=eos_token if cls._token_id(backend, eos_token) is not None else None,
        )

    @staticmethod
    def _token_id(backend: _Backend, token: str | None) -> int | None:
        return None if token is None else backend.token_to_id(token)

    @staticmethod
    def _folder_eos_ids(backend: _Backend, path: Path, eos_token: str | None) -> set[int]:
        """EOS from tokenizer_config.json plus generation_config.json's list.

        Chat models often stop on more than one token (e.g. <|im_end|> and <|endoftext|>);
        generation_config.json is where transformers' generate() reads them from.
        """
        ids: set[int] = set()
        eos = Tokenizer._token_id(backend, eos_token)
        if eos is not None:
            ids.add(eos)
        generation_file = path / "generation_config.json"
        if generation_file.is_file():
            ids.update(_as_int_list(_read_json(generation_file).get("eos_token_id")))
        return ids

    @staticmethod
    def _backend_vocab_size(backend: _Backend) -> int:
        # One past the highest id, not the count: ids may have holes or duplicate strings.
        return max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    # ---- tokens ----------------------------------------------------------------------

    @cached_property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self._backend.id_to_token(self.bos_token_id)

    @cached_property
    def eos_token(self) -> str | None:
        """The template's `eos_token`: the configured EOS, else the lowest EOS id's token."""
        if self._eos_token is not None:
            return self._eos_token
        if not self.eos_token_ids:
            return None
        return self._backend.id_to_token(min(self.eos_token_ids))

    @cached_property
    def max_token_chars(self) -> int:
        """The longest token's text: no token covers more characters of a text than this."""
        return max(map(len, self._backend.get_vocab()), default=1) or 1

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))``, without encoding (for refusing long prompts cheaply)."""
        return -(-len(text) // self.max_token_chars)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in it become their single ids.

        A rendered chat template already contains whatever BOS the model wants, so encode
        it with add_special_tokens=False (as transformers' apply_chat_template does).
        """
        if not isinstance(text, str):
            raise TokenizerError(f"encode needs a str, got {type(text).__name__}")
        # The backend's post-processor is bypassed: whether BOS goes first is decided by
        # add_bos alone, identically for GGUF and folder tokenizers.
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = list(ids)
        self._check_ids(ids)
        # tokenizers' Python decode defaults to skipping special tokens: always say which.
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def _check_ids(self, ids: Sequence[int]) -> None:
        # The backend silently drops unknown ids; a bad id is a bug upstream, so say so.
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise TokenizerError(f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")

    def detokenizer(self, skip_special_tokens: bool = False) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    # ---- chat ------------------------------------------------------------------------

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise TokenizerError(_NO_TEMPLATE_HINT)
        return _compile_template(self.chat_template)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` to the prompt text the model was trained on."""
        _validate_messages(messages)
        template = self._compiled_template
        variables: dict[str, Any] = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            # Templates with tool support test these; HF always defines them.
            "tools": None,
            "documents": None,
        }
        variables.update(kwargs)
        variables["messages"] = messages
        variables["add_generation_prompt"] = add_generation_prompt
        try:
            return template.render(**variables)
        except Exception as exc:  # the template is foreign code: any failure in it is its own
            raise TokenizerError(f"the chat template failed to render: {exc}") from exc


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that are always whole characters.

    Decoding each token alone is wrong (byte-level tokens can end mid-character, and some
    decoders treat the first token specially), and re-decoding everything each step is
    quadratic. As vLLM and mlx-lm do, we decode only a short window: the tokens since
    `_prefix_offset` (the start of the last emitted chunk, for context) and compare it with
    the text of that window up to `_read_offset` (what is already emitted); the difference
    is new text. While the window ends in U+FFFD, the last token(s) stopped inside a UTF-8
    sequence, so nothing is emitted until later tokens complete it (or finalize()).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self._chunks: list[str] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""  # decode(token_ids[_prefix_offset:_read_offset])

    @property
    def text(self) -> str:
        """All text emitted so far (held-back bytes excluded until they complete)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly "")."""
        token_id = int(token_id)
        self._tokenizer._check_ids([token_id])
        self.token_ids.append(token_id)
        window_text = self._decode_window()
        if len(window_text) <= len(self._prefix_text) or window_text.endswith("\ufffd"):
            return ""
        return self._emit(window_text)

    def finalize(self) -> str:
        """Emit whatever is held back (an incomplete character comes out as U+FFFD)."""
        if self._read_offset == len(self.token_ids):
            return ""
        return self._emit(self._decode_window())

    def _decode_window(self) -> str:
        return self._decode(self.token_ids[self._prefix_offset :])

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _emit(self, window_text: str) -> str:
        delta = window_text[len(self._prefix_text) :]
        # The window now starts where this chunk did: everything before it is settled.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self._prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        self._chunks.append(delta)
        return delta


__all__: list[str] = ["IncrementalDetokenizer", "Tokenizer"]
