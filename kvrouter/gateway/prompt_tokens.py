"""Prompt text -> token ids for the gateway, tokenizing only what a cache does not hold.

Multi-turn chat re-sends the whole history each turn; the gateway keeps the
token ids of a rendered prefix (LRU, bounded in bytes, keyed by an xxh3-128
hash of the prefix text) so that a follow-up turn tokenizes only its new text.

Where a prompt may be cut. The ``tokenizers`` pipeline first splits the text
at *added tokens* (``<|im_start|>``...; Aho-Corasick, leftmost-longest), then
normalizes, pre-tokenizes and runs the model on each piece on its own. So
``encode(T) == encode(T[:p]) + encode(T[p:])`` when ``p`` is a boundary of
that split in ``T`` and in both halves, which holds when

1. an added token starts at ``p``, and
2. no occurrence of any added token straddles ``p`` (starts before, ends after),

because every match the scan makes before ``p`` then ends by ``p`` (so the
scan of ``T[:p]`` makes the same ones), and the scan reaches ``p`` and matches
there, as the scan of ``T[p:]`` does. That needs a pipeline whose pieces are
independent: no normalizer, pre-tokenizers that work per piece (byte-level
without an added prefix space, digits, regex splits, whitespace, punctuation),
added tokens that strip nothing around them, no truncation or padding, and no
post-processor (or ``add_special_tokens=False``, chat's case).
:func:`prefix_cache_support` checks this once per tokenizer; one that does not
qualify tokenizes every prompt whole. A cached entry ``hash(T[:p]) -> ids`` is
stored only for such a cut, so a hit returns exactly ``encode(T[:p])``.

Cuts inside plain text (no added token) are not provably stable (BPE merges
and regex look-ahead cross them), so a plain prompt without added tokens is
tokenized whole.

The prompt-token limit. A byte-level token covers at most ``L`` bytes (the
vocabulary's longest entry), so a text of ``n`` characters has at least
``n / L`` tokens: beyond ``limit * L`` characters it is refused untokenized
(weak for SmolLM2, whose ``L`` is 81). Beyond that, the uncached text is
tokenized in chunks cut as above, and counting stops at the first chunk that
crosses the limit.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import xxhash

from engine_worker.tokenizer import Tokenizer

__all__ = ["PromptTokenizer", "PromptTooLongError", "TokenPrefixCache", "prefix_cache_support"]

#: Pre-tokenizers that split each added-token piece on its own, as if alone.
_PIECEWISE = frozenset({"Digits", "Split", "Whitespace", "WhitespaceSplit", "Punctuation"})

#: Uncached text is tokenized in chunks of about this many characters (at valid cuts),
#: so that a prompt over the limit stops being counted early.
CHUNK_CHARS = 256 * 1024


class PromptTooLongError(ValueError):
    """The prompt has more tokens than allowed.

    Attributes:
        at_least: Tokens counted (or bounded from below) when counting stopped.
        exact: Whether ``at_least`` is the prompt's exact length.
    """

    def __init__(self, at_least: int, exact: bool) -> None:
        super().__init__(f"at least {at_least} tokens")
        self.at_least = at_least
        self.exact = exact


def _pre_tokenizer_ok(spec: dict[str, object] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        steps = spec.get("pretokenizers")
        return isinstance(steps, list) and all(_pre_tokenizer_ok(s) for s in steps)
    if kind == "ByteLevel":
        return not spec.get("add_prefix_space", False)
    return kind in _PIECEWISE


def prefix_cache_support(tokenizer: Tokenizer) -> str | None:
    """None when prompts of ``tokenizer`` may be cut at added tokens, else why not."""
    spec = json.loads(tokenizer.backend.to_str())
    if spec.get("normalizer") is not None:
        return "it has a normalizer"
    if not _pre_tokenizer_ok(spec.get("pre_tokenizer")):
        return "its pre-tokenizer does not split pieces independently"
    if spec.get("truncation") is not None or spec.get("padding") is not None:
        return "it truncates or pads"
    if (spec.get("model") or {}).get("dropout"):
        return "its model has dropout"
    added = tokenizer.backend.get_added_tokens_decoder().values()
    if not added:
        return "it has no added tokens to cut at"
    if any(t.lstrip or t.rstrip or t.single_word for t in added):
        return "an added token strips or matches whole words only"
    return None


def _max_token_chars(tokenizer: Tokenizer) -> int | None:
    """Most characters one token covers, when the vocabulary is byte-level (else None)."""
    pre = json.loads(tokenizer.backend.to_str()).get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if not any(s.get("type") == "ByteLevel" for s in steps):
        return None
    vocab = tokenizer.backend.get_vocab(with_added_tokens=False)
    added = tokenizer.backend.get_added_tokens_decoder().values()
    # A byte-level vocabulary spells each byte as one character: length == bytes >= chars.
    return max([*(len(t) for t in vocab), *(len(t.content) for t in added), 1])


@dataclass(slots=True)
class TokenPrefixCache:
    """Token ids of text prefixes, least recently used dropped first past ``max_bytes``.

    Thread-safe: the gateway tokenizes in worker threads.
    """

    max_bytes: int = 64 * 1024 * 1024
    seed: int = field(default_factory=lambda: secrets.randbits(64))
    _entries: OrderedDict[int, array[int]] = field(default_factory=OrderedDict)
    _bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    hits: int = 0
    misses: int = 0

    #: Bytes counted per entry beyond its ids (key, dict slot, array header).
    OVERHEAD = 160

    @property
    def size_bytes(self) -> int:
        """Bytes the entries take (as counted against ``max_bytes``)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: int) -> array[int] | None:
        """The ids stored under ``key`` (marked as recently used), or None."""
        with self._lock:
            ids = self._entries.get(key)
            if ids is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return ids

    def put(self, key: int, ids: array[int]) -> None:
        """Store ``ids`` under ``key``, dropping the least recently used past the budget."""
        cost = ids.itemsize * len(ids) + self.OVERHEAD
        if cost > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.itemsize * len(old) + self.OVERHEAD
            self._entries[key] = ids
            self._bytes += cost
            while self._bytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= dropped.itemsize * len(dropped) + self.OVERHEAD

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0


class PromptTokenizer:
    """One model's prompt tokenizer with its prefix cache (see the module docstring).

    Args:
        tokenizer: The model's tokenizer (the workers' own).
        cache_bytes: Budget of the prefix cache (0: no cache).
    """

    def __init__(self, tokenizer: Tokenizer, cache_bytes: int = 64 * 1024 * 1024) -> None:
        self.tokenizer = tokenizer
        self.unsupported = prefix_cache_support(tokenizer)
        self.cache = TokenPrefixCache(max_bytes=cache_bytes)
        self.max_token_chars = _max_token_chars(tokenizer)
        added = sorted(
            {t.content for t in tokenizer.backend.get_added_tokens_decoder().values()},
            key=len,
            reverse=True,
        )
        # Longest first: at a given position the regex matches the longest added token.
        self._added = re.compile("|".join(map(re.escape, added))) if added else None
        self._longest = len(added[0]) if added else 0

    @property
    def caching(self) -> bool:
        """Whether prompts are cut and cached (the tokenizer qualifies, a budget is set)."""
        return self.unsupported is None and self.cache.max_bytes > 0

    def cuts(self, text: str) -> list[int]:
        """Positions ``p`` (ascending, > 0) where ``encode(text)`` splits exactly in two."""
        rx = self._added
        if rx is None:
            return []
        out = []
        for m in rx.finditer(text):
            p = m.start()
            if p > 0 and not self._straddled(text, p):
                out.append(p)
        return out

    def _straddled(self, text: str, p: int) -> bool:
        """Whether an added token occurs across ``p`` (starting before it, ending after)."""
        assert self._added is not None
        for s in range(max(0, p - self._longest + 1), p):
            m = self._added.match(text, s)
            if m is not None and m.end() > p:
                return True
        return False

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """``tokenizer.encode``, letting other threads run meanwhile.

        NOTE: ``tokenizers``' ``encode`` holds the GIL for its whole run (a 1 MiB prompt
        stalls every thread for half a second); the batch entry points release it and
        return the same ids. ``encode_batch_fast`` also skips computing offsets.
        """
        if not isinstance(text, str):
            raise TypeError(f"can only encode str, got {type(text).__name__}")
        batch = getattr(self.tokenizer.backend, "encode_batch_fast", None)
        batch = batch or self.tokenizer.backend.encode_batch
        return list(batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def _keys(self, text: str, cuts: list[int]) -> list[int]:
        """The cache key of ``text[:p]`` for each cut ``p``, hashed in one pass."""
        h = xxhash.xxh3_128(seed=self.cache.seed)
        keys = []
        pos = 0
        for p in cuts:
            h.update(text[pos:p].encode("utf-8", "surrogatepass"))
            keys.append(h.intdigest())
            pos = p
        return keys

    def encode(
        self, text: str, *, add_special_tokens: bool = True, limit: int | None = None
    ) -> list[int]:
        """``tokenizer.encode(text, add_special_tokens)``, from the cache where it can.

        Raises:
            PromptTooLongError: ``limit`` is set and the prompt has more tokens; counting
                stops as soon as that is known.
        """
        if limit is not None and self.max_token_chars is not None:
            at_least = math.ceil(len(text) / self.max_token_chars)
            if at_least > limit:
                raise PromptTooLongError(at_least, exact=False)
        tok = self.tokenizer
        has_post = tok.backend.post_processor is not None
        if not self.caching or (add_special_tokens and has_post):
            whole = self._encode(text, add_special_tokens)
            if limit is not None and len(whole) > limit:
                raise PromptTooLongError(len(whole), exact=True)
            return whole
        cuts = self.cuts(text)
        keys = self._keys(text, cuts)
        ids: list[int] = []
        start = 0
        for p, key in zip(reversed(cuts), reversed(keys), strict=True):
            cached = self.cache.get(key)
            if cached is not None:
                ids.extend(cached)
                start = p
                break
        if limit is not None and len(ids) > limit:
            raise PromptTooLongError(len(ids), exact=False)
        last = cuts[-1] if cuts else 0
        ends = [p for p in _chunk_ends(cuts, start, len(text)) if p != last]
        if last > start:
            ends = sorted({*ends, last})
        pos = start
        for end in ends:
            ids.extend(self._encode(text[pos:end], False))
            pos = end
            if end == last:
                self.cache.put(keys[-1], array("I", ids))
            if limit is not None and len(ids) > limit:
                raise PromptTooLongError(len(ids), exact=end == len(text))
        return ids


def _chunk_ends(cuts: list[int], start: int, end: int) -> list[int]:
    """Ends of chunks of about :data:`CHUNK_CHARS` from ``start``, at cuts; ``end`` last."""
    out = []
    mark = start
    for p in cuts:
        if p > start and p - mark >= CHUNK_CHARS and p < end:
            out.append(p)
            mark = p
    out.append(end)
    return out
