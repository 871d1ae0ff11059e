"""The model's tokenizer, shared by the router and the worker (no torch).

The router hashes prompts into block keys from token ids, so it must
tokenize exactly as the worker does: both call :func:`load_tokenizer` with
the same model spec and get the same :class:`Tokenizer`.

Two sources:

* a Hugging Face directory: ``tokenizer.json`` (loaded as is) plus
  ``tokenizer_config.json`` / ``chat_template.jinja`` / ``generation_config.json``
  for special tokens and the chat template;
* a GGUF file: a byte-level BPE rebuilt from ``tokenizer.ggml.*`` metadata
  (tokens, merges, token types, special ids, ``add_bos_token``), with the
  pre-tokenizer llama.cpp selects by ``tokenizer.ggml.pre`` (regexes as in
  llama.cpp's ``llama-vocab.cpp``; ``smollm`` splits digits one by one, as
  SmolLM2's own ``tokenizer.json`` does).
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import xxhash
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.decoders import DecodeStream

log = logging.getLogger(__name__)

__all__ = [
    "GGUF_PRE_TOKENIZERS",
    "IncrementalDecoder",
    "Tokenizer",
    "TokenizerError",
    "load_tokenizer",
]

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: ``tokenizer.ggml.pre`` values we reproduce -> (split regex, or None for byte-level
#: BPE's own GPT-2 regex; whether digits are split one by one first).
GGUF_PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {
    "default": (None, False),
    "gpt2": (None, False),
    "smollm": (None, True),
    "starcoder": (None, True),
    "refact": (None, True),
    "codeshell": (None, True),
    "llama-bpe": (_LLAMA3_SPLIT, False),
    "qwen2": (_QWEN2_SPLIT, False),
}
_CONTROL, _USER_DEFINED = 3, 4


class TokenizerError(ValueError):
    """A tokenizer cannot be built from its source, or was given bad input."""


class IncrementalDecoder:
    """Turns generated token ids into text deltas, one token at a time.

    A character split across tokens (UTF-8 bytes of an emoji, say) is held
    back until complete, so no delta ever carries a broken character; the
    deltas concatenate to the same text as decoding all tokens at once.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool):
        self._backend = tokenizer.backend
        self._stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=skip_special_tokens)
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._text: list[str] = []

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes ("" if none yet)."""
        try:
            delta = self._stream.step(self._backend, token_id)
        except Exception as exc:
            raise TokenizerError(f"cannot decode token id {token_id}: {exc}") from exc
        self._ids.append(token_id)
        if delta:
            self._text.append(delta)
        return delta or ""

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._text)

    def finish(self) -> str:
        """Flush what is still held back (an incomplete character decodes as U+FFFD)."""
        full = self._backend.decode(self._ids, skip_special_tokens=self._skip)
        emitted = self.text
        rest = full[len(emitted) :] if full.startswith(emitted) else ""
        if rest:
            self._text.append(rest)
        return rest


class Tokenizer:
    """A model's tokenizer: ids, special tokens and chat template.

    Build one with :meth:`from_gguf`, :meth:`from_hf_dir` or
    :func:`load_tokenizer`.

    Args:
        backend: The ``tokenizers`` tokenizer doing the work.
        bos_token: Beginning-of-sequence token text, if any.
        eos_token: End-of-sequence token text, if any.
        eos_token_ids: Every id that ends generation (eos, end-of-turn...).
        chat_template: The model's Jinja chat template, if it has one.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token: str | None,
        eos_token: str | None,
        eos_token_ids: Iterable[int],
        chat_template: str | None,
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self.chat_template = chat_template

    @functools.cached_property
    def fingerprint(self) -> str:
        """What two processes compare to know they turn the same text into the same ids.

        xxh3-64 (hex) of the tokenizer's serialized form, its BOS/EOS tokens and its
        chat template: equal fingerprints tokenize, and render chats, alike. Computed
        once (serializing the tokenizer takes ~20 ms).
        """
        h = xxhash.xxh3_64()
        for part in (self.backend.to_str(), self.bos_token, self.eos_token, self.chat_template):
            h.update((part or "").encode("utf-8", "surrogatepass"))
            h.update(b"\0")
        return h.hexdigest()

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        """Id of :attr:`bos_token`, if any."""
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text map to their ids.

        Args:
            text: The text.
            add_special_tokens: Add what the model adds around a sequence (e.g. BOS
                for Llama); SmolLM2 adds nothing.
        """
        if not isinstance(text, str):
            raise TokenizerError(f"can only encode str, got {type(text).__name__}")
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``.

        Raises:
            TokenizerError: An id outside the vocabulary.
        """
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(f"token ids {bad[:5]} outside vocab of {self.vocab_size}")
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def incremental_decoder(
        self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> IncrementalDecoder:
        """A streaming detokenizer for tokens generated after ``prompt_ids``."""
        return IncrementalDecoder(self, prompt_ids, skip_special_tokens)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Rebuild a GGUF file's byte-level BPE tokenizer from its metadata.

        Raises:
            FileNotFoundError: No such file.
            TokenizerError: Not a GGUF, no tokenizer, or one we do not reproduce.
        """
        meta = _gguf_tokenizer_metadata(Path(path))
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(f"GGUF tokenizer model {kind!r} is not supported; only 'gpt2' BPE")
        pre = str(meta.get("tokenizer.ggml.pre", "default"))
        if pre not in GGUF_PRE_TOKENIZERS:
            raise TokenizerError(
                f"GGUF pre-tokenizer {pre!r} is not supported; one of {sorted(GGUF_PRE_TOKENIZERS)}"
            )
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        split, digits = GGUF_PRE_TOKENIZERS[pre]
        backend = Backend(
            models.BPE(
                {t: i for i, t in enumerate(tokens)},
                merges,
                ignore_merges=pre == "llama-bpe",
            )
        )
        steps: list[pre_tokenizers.PreTokenizer] = []
        if digits:
            steps.append(pre_tokenizers.Digits(individual_digits=True))
        if split is not None:
            steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None))
        backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
        backend.decoder = decoders.ByteLevel()
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        backend.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t, k in zip(tokens, types, strict=True)
                if k == _CONTROL
            ]
        )
        backend.add_tokens(
            [
                AddedToken(t, special=False, normalized=False)
                for t, k in zip(tokens, types, strict=True)
                if k == _USER_DEFINED
            ]
        )

        def token(key: str) -> str | None:
            idx = meta.get(f"tokenizer.ggml.{key}")
            return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

        bos, eos = token("bos_token_id"), token("eos_token_id")
        _set_bos_eos_processor(
            backend,
            bos if meta.get("tokenizer.ggml.add_bos_token", False) else None,
            eos if meta.get("tokenizer.ggml.add_eos_token", False) else None,
            tokens,
        )
        eos_ids = [
            meta[k]
            for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
            if k in meta
        ]
        return cls(
            backend,
            bos_token=bos,
            eos_token=eos,
            eos_token_ids=eos_ids,
            chat_template=meta.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, directory: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` and its companions from a transformers directory.

        Raises:
            FileNotFoundError: No ``tokenizer.json``.
            TokenizerError: Unreadable tokenizer files.
        """
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {directory}")
        try:
            backend = Backend.from_file(str(path))
        except Exception as exc:
            raise TokenizerError(f"cannot read {path}: {exc}") from exc
        config = _read_json(directory / "tokenizer_config.json")
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        eos_ids = [] if eos is None else [backend.token_to_id(eos)]
        generation_eos = _read_json(directory / "generation_config.json").get("eos_token_id")
        if generation_eos is not None:
            eos_ids += generation_eos if isinstance(generation_eos, list) else [generation_eos]
        template_file = directory / "chat_template.jinja"
        template = (
            template_file.read_text() if template_file.is_file() else config.get("chat_template")
        )
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        return cls(
            backend,
            bos_token=bos,
            eos_token=eos,
            eos_token_ids=[i for i in eos_ids if i is not None],
            chat_template=template,
        )


def _set_bos_eos_processor(
    backend: Backend, bos: str | None, eos: str | None, tokens: Sequence[str]
) -> None:
    """Add BOS/EOS around every encoded sequence, as llama.cpp's add_*_token flags say."""
    if bos is None and eos is None:
        return
    ids = {t: tokens.index(t) for t in (bos, eos) if t is not None}
    pre, post = ([bos] if bos else []), ([eos] if eos else [])
    backend.post_processor = processors.TemplateProcessing(
        single=[*pre, "$A", *post],
        pair=[*pre, "$A", *post, *pre, "$B", *post],
        special_tokens=list(ids.items()),
    )


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"cannot parse {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _gguf_tokenizer_metadata(path: Path) -> dict[str, Any]:
    from gguf import GGUFReader

    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise TokenizerError(f"{path} is not a readable GGUF file: {exc}") from exc
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    if "tokenizer.ggml.tokens" not in meta:
        raise TokenizerError(f"{path} carries no tokenizer (tokenizer.ggml.tokens)")
    return meta


def _cache_dir() -> Path:
    root = os.environ.get("KVROUTER_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvrouter"
    )
    return Path(root) / "tokenizers"


def _from_gguf_disk_cached(path: str) -> Tokenizer:
    """:meth:`Tokenizer.from_gguf`, memoized on disk as tokenizer JSON.

    Rebuilding from GGUF metadata takes seconds (reading the file's fields);
    every worker and router start would pay it. The cache entry is keyed by
    the file's path, size and mtime, written atomically, and ignored if it
    cannot be read back.
    """
    st = os.stat(path)
    digest = xxhash.xxh3_64_hexdigest(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    entry = _cache_dir() / f"{digest}.json"
    try:
        data = json.loads(entry.read_text())
        return Tokenizer(
            Backend.from_str(data["backend"]),
            bos_token=data["bos_token"],
            eos_token=data["eos_token"],
            eos_token_ids=data["eos_token_ids"],
            chat_template=data["chat_template"],
        )
    except Exception:  # missing, stale or unreadable entry (tokenizers raises bare Exception)
        log.debug("tokenizer cache miss for %s", path)
    tok = Tokenizer.from_gguf(path)
    payload = {
        "backend": tok.backend.to_str(),
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "eos_token_ids": list(tok.eos_token_ids),
        "chat_template": tok.chat_template,
    }
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(payload))
        os.replace(tmp, entry)
    except OSError:
        pass  # a read-only home: no cache, still correct
    return tok


@functools.lru_cache(maxsize=16)
def _load_cached(kind: str, path: str) -> Tokenizer:
    return _from_gguf_disk_cached(path) if kind == "gguf" else Tokenizer.from_hf_dir(path)


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer of model ``spec`` ("smollm2", "tiny", a .gguf file or an HF directory).

    Loaded once per source path and shared afterwards (treat it as read-only).

    Raises:
        FileNotFoundError: The spec names no existing model.
        TokenizerError: The source holds no usable tokenizer.
    """
    from engine_worker.model.registry import resolve

    source = resolve(spec).tokenizer_path
    kind = "gguf" if source.suffix == ".gguf" else "hf"
    return _load_cached(kind, str(source.resolve()))
