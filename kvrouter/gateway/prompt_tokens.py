r"""Prompt text -> token ids for the gateway, tokenizing only what a cache does not hold.

Multi-turn chat re-sends the whole history each turn, and long-document prompts often
share a long prefix with an earlier one; the gateway keeps the token ids of prompt
prefixes (LRU, bounded in bytes, keyed by an xxh3-128 hash of the prefix text) so that
a follow-up tokenizes only its new text.

Where a prompt may be cut. ``p`` is a *cut* of ``T`` when
``encode(T) == encode(T[:p]) + encode(T[p:])``. The ``tokenizers`` pipeline first
splits the text at *added tokens* (``<|im_start|>``...; Aho-Corasick, leftmost-longest),
then normalizes and pre-tokenizes each piece on its own, and runs the model on each
pre-token on its own. So ``p`` is a cut when it is a boundary of both splits in ``T``
and in both halves. That needs a pipeline whose pieces are independent: no normalizer,
pre-tokenizers that work per piece (byte-level without an added prefix space, digits,
regex splits, whitespace, punctuation), added tokens that strip nothing around them, no
truncation or padding, and no post-processor (or ``add_special_tokens=False``, chat's
case). Two kinds of position are cuts:

* *Added-token cuts* (:func:`prefix_cache_support`): an added token starts at ``p`` and
  no occurrence of any added token straddles ``p`` (starts before, ends after). Every
  match the scan makes before ``p`` then ends by ``p`` (so the scan of ``T[:p]`` makes
  the same ones), and the scan reaches ``p`` and matches there, as that of ``T[p:]``.
* *Plain-text cuts* (:func:`plain_cut_support`), for a BPE whose pre-tokenizer is
  GPT-2's byte-level regex, after a digits split or not::

      's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+

  ``T[p]`` is a space, ``T[p + 1]`` a letter (``str.isalpha``), and no added token
  starts at ``p + 1`` (none may hold a space, so none covers ``p``). The digits split
  cuts only next to a digit, so ``p`` and ``p + 1`` lie in one piece. There a match
  takes a space only as its first character or within a whitespace run; a run reaching
  ``p`` meets the letter and ``\s+(?!\S)`` backs off to end at ``p``, and any other
  match stops at the space: so a match ends at ``p`` and the next one (space, letters)
  starts there. Every match begun before ``p`` ends there in ``T[:p]`` too: the end of
  the text, like the space, is no letter, digit or other character, and passes the
  look-ahead ``(?!\S)``. The regex looks nothing behind, so ``T[p:]`` splits as ``T``
  does from ``p``. A space before a digit is no cut: after whitespace, the
  digits split would end the piece at the space, and the run would swallow it.

What the cache keeps. A prompt's *cached cuts* are its added-token cuts and the first
plain-text cut at or after each multiple of :data:`PLAIN_CUT_CHARS`. The cached cuts of
``T`` below a cut ``p`` are those of ``T[:p]``, so prompts that share a prefix find the
same entries in it. Each entry holds the ids of one segment, since the cut before::

    T        |  segment 0   |  segment 1   |  segment 2   |  tail  |
             0              c1             c2             c3       len(T)
    entries  hash(T[:c1]) -> encode(T[0:c1])
             hash(T[:c2]) -> encode(T[c1:c2])
             hash(T[:c3]) -> encode(T[c2:c3])

A lookup takes the longest run of entries present from the start and tokenizes the
rest, segment by segment; the chain is then stored again head last, so the LRU drops a
chain's tail before the head it depends on. An entry costs 4 bytes per token of its
own segment (plus :attr:`TokenPrefixCache.OVERHEAD`), not a copy of the whole prefix.

The prompt-token limit. A byte-level token covers at most ``L`` bytes (the
vocabulary's longest entry), so a text of ``n`` characters has at least ``n / L``
tokens: beyond ``limit * L`` characters it is refused untokenized (weak for SmolLM2,
whose ``L`` is 81). Beyond that, the uncached text is tokenized in chunks of about
:data:`CHUNK_CHARS` ending at cuts, and counting stops at the first chunk that crosses
the limit.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import threading
import weakref
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from engine_worker.tokenizer import Tokenizer

__all__ = [
    "PLAIN_CUT_CHARS",
    "PromptTokenizer",
    "PromptTooLongError",
    "TokenPrefixCache",
    "plain_cut_support",
    "prefix_cache_support",
]

#: Pre-tokenizers that split each added-token piece on its own, as if alone.
_PIECEWISE = frozenset({"Digits", "Split", "Whitespace", "WhitespaceSplit", "Punctuation"})

#: Uncached text is tokenized in chunks of about this many characters (at cuts),
#: so that a prompt over the limit stops being counted early.
CHUNK_CHARS = 256 * 1024

#: The cache keeps a plain-text cut about this often (characters): a prompt sharing a
#: prefix with an earlier one tokenizes about this much of the shared text again (more
#: where no space precedes a letter, as in text without spaces).
PLAIN_CUT_CHARS = 4096

#: A space before a character that may be a letter; :meth:`PromptTokenizer.plain_cuts`
#: keeps those followed by one (``[^\W\d_]`` also takes non-decimal numbers).
_SPACE_LETTER = re.compile(r" (?=[^\W\d_])")


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


def _pre_tokenizer_ok(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        steps = spec.get("pretokenizers")
        return isinstance(steps, list) and all(_pre_tokenizer_ok(s) for s in steps)
    if kind == "ByteLevel":
        return not spec.get("add_prefix_space", False)
    return kind in _PIECEWISE


def _gpt2_byte_level(spec: dict[str, Any] | None) -> bool:
    """Whether ``spec`` is GPT-2's byte-level regex, after a digits split or not."""
    sequence = spec is not None and spec.get("type") == "Sequence"
    steps = spec.get("pretokenizers") if spec is not None and sequence else [spec]
    if not isinstance(steps, list) or not 1 <= len(steps) <= 2:
        return False
    *digits, last = steps
    return (
        all(isinstance(s, dict) and s.get("type") == "Digits" for s in digits)
        and isinstance(last, dict)
        and last.get("type") == "ByteLevel"
        and last.get("use_regex", True) is True
        and not last.get("add_prefix_space", False)
    )


def _spec(tokenizer: Tokenizer) -> dict[str, Any]:
    """The tokenizer's JSON spec (``tokenizer.json``'s content)."""
    spec: dict[str, Any] = json.loads(tokenizer.backend.to_str())
    return spec


def _pipeline_problem(tokenizer: Tokenizer, spec: dict[str, Any]) -> str | None:
    """Why the pipeline's pieces are not independent (see the module docstring), or None."""
    if spec.get("normalizer") is not None:
        return "it has a normalizer"
    if not _pre_tokenizer_ok(spec.get("pre_tokenizer")):
        return "its pre-tokenizer does not split pieces independently"
    if spec.get("truncation") is not None or spec.get("padding") is not None:
        return "it truncates or pads"
    if (spec.get("model") or {}).get("dropout"):
        return "its model has dropout"
    added = tokenizer.backend.get_added_tokens_decoder().values()
    if any(t.lstrip or t.rstrip or t.single_word for t in added):
        return "an added token strips or matches whole words only"
    return None


def _added_token_problem(tokenizer: Tokenizer, spec: dict[str, Any]) -> str | None:
    """Why prompts may not be cut at added tokens, or None."""
    problem = _pipeline_problem(tokenizer, spec)
    if problem is None and not tokenizer.backend.get_added_tokens_decoder():
        return "it has no added tokens to cut at"
    return problem


def _plain_text_problem(tokenizer: Tokenizer, spec: dict[str, Any]) -> str | None:
    """Why prompts may not be cut inside plain text, or None."""
    problem = _pipeline_problem(tokenizer, spec)
    if problem is not None:
        return problem
    if (spec.get("model") or {}).get("type") != "BPE":
        return "its model is not BPE"
    if not _gpt2_byte_level(spec.get("pre_tokenizer")):
        return "its pre-tokenizer is not GPT-2's byte-level regex (after a digits split or not)"
    if any(" " in t.content for t in tokenizer.backend.get_added_tokens_decoder().values()):
        return "an added token contains a space"
    return None


def prefix_cache_support(tokenizer: Tokenizer) -> str | None:
    """None when prompts of ``tokenizer`` may be cut at added tokens, else why not."""
    return _traits(tokenizer).added_token_problem


def plain_cut_support(tokenizer: Tokenizer) -> str | None:
    """None when prompts of ``tokenizer`` may be cut inside plain text, else why not."""
    return _traits(tokenizer).plain_text_problem


def _max_token_chars(tokenizer: Tokenizer, spec: dict[str, Any]) -> int | None:
    """Most characters one token covers, when the vocabulary is byte-level (else None)."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if not any(s.get("type") == "ByteLevel" for s in steps):
        return None
    vocab = tokenizer.backend.get_vocab(with_added_tokens=False)
    added = tokenizer.backend.get_added_tokens_decoder().values()
    # A byte-level vocabulary spells each byte as one character: length == bytes >= chars.
    return max([*(len(t) for t in vocab), *(len(t.content) for t in added), 1])


@dataclass(frozen=True, slots=True)
class _Traits:
    """What a :class:`PromptTokenizer` needs to know of its tokenizer (see :func:`_traits`)."""

    added_token_problem: str | None
    plain_text_problem: str | None
    max_token_chars: int | None
    #: Matches any added token, longest first; None when there is none.
    added: re.Pattern[str] | None
    #: Characters of the longest added token (0: none).
    longest: int


#: Each tokenizer's traits, derived once: parsing its JSON spec and scanning its
#: vocabulary take ~0.1 s, and a gateway may build a :class:`PromptTokenizer` per model
#: more than once (a reload, a test per example). A :class:`Tokenizer` is not changed
#: once built (nothing in the product adds tokens to a loaded one), so they stay true.
_TRAITS: weakref.WeakKeyDictionary[Tokenizer, _Traits] = weakref.WeakKeyDictionary()
_TRAITS_LOCK = threading.Lock()


def _traits(tokenizer: Tokenizer) -> _Traits:
    """``tokenizer``'s traits, from the cache or derived (thread-safe)."""
    with _TRAITS_LOCK:
        got = _TRAITS.get(tokenizer)
    if got is not None:
        return got
    spec = _spec(tokenizer)
    added = sorted(
        {t.content for t in tokenizer.backend.get_added_tokens_decoder().values()},
        key=len,
        reverse=True,
    )
    got = _Traits(
        added_token_problem=_added_token_problem(tokenizer, spec),
        plain_text_problem=_plain_text_problem(tokenizer, spec),
        max_token_chars=_max_token_chars(tokenizer, spec),
        # Longest first: at a given position the regex matches the longest added token.
        added=re.compile("|".join(map(re.escape, added))) if added else None,
        longest=len(added[0]) if added else 0,
    )
    with _TRAITS_LOCK:
        return _TRAITS.setdefault(tokenizer, got)


def _cost(ids: array[int]) -> int:
    """Bytes an entry counts against the cache's budget."""
    return ids.itemsize * len(ids) + TokenPrefixCache.OVERHEAD


@dataclass(slots=True)
class TokenPrefixCache:
    """Chains of token-id segments keyed by text prefix, least recently used dropped first.

    Entry ``i`` of a chain holds the ids of one segment of a prompt, keyed by the hash of
    the text up to the segment's end (see the module docstring); the budget
    ``max_bytes`` counts each entry's ids plus :attr:`OVERHEAD`. Thread-safe: the
    gateway tokenizes in worker threads.

    Attributes:
        hits: Lookups that found at least one entry.
        misses: Lookups that found none.
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

    def get_run(self, keys: Sequence[int]) -> list[array[int]]:
        """The entries under ``keys[0]``, ``keys[1]``... up to the first missing one."""
        found = []
        with self._lock:
            for key in keys:
                ids = self._entries.get(key)
                if ids is None:
                    break
                found.append(ids)
            if found:
                self.hits += 1
            else:
                self.misses += 1
        return found

    def put_run(self, keys: Sequence[int], segments: Sequence[array[int]]) -> None:
        """Store ``segments[i]`` under ``keys[i]``, ``segments[0]`` most recently used.

        NOTE: a chain serves a lookup only from its head on, so it is stored tail first:
        past the budget, the least recently used order drops its tail before its head.
        """
        with self._lock:
            for key, ids in zip(reversed(keys), reversed(segments), strict=True):
                cost = _cost(ids)
                if cost > self.max_bytes:
                    continue
                old = self._entries.pop(key, None)
                if old is not None:
                    self._bytes -= _cost(old)
                self._entries[key] = ids
                self._bytes += cost
                while self._bytes > self.max_bytes:
                    _, dropped = self._entries.popitem(last=False)
                    self._bytes -= _cost(dropped)

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
        plain_cut_chars: How often (characters) the cache keeps a plain-text cut.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        cache_bytes: int = 64 * 1024 * 1024,
        plain_cut_chars: int = PLAIN_CUT_CHARS,
    ) -> None:
        if plain_cut_chars < 1:
            raise ValueError(f"plain_cut_chars must be >= 1, got {plain_cut_chars}")
        traits = _traits(tokenizer)
        self.tokenizer = tokenizer
        self.unsupported = traits.added_token_problem
        self.plain_unsupported = traits.plain_text_problem
        self.plain_cut_chars = plain_cut_chars
        self.cache = TokenPrefixCache(max_bytes=cache_bytes)
        self.max_token_chars = traits.max_token_chars
        self._added = traits.added
        self._longest = traits.longest

    @property
    def caching(self) -> bool:
        """Whether prompts are cut and cached (the tokenizer qualifies, a budget is set)."""
        cuttable = self.unsupported is None or self.plain_unsupported is None
        return cuttable and self.cache.max_bytes > 0

    def cuts(self, text: str) -> list[int]:
        """The cached cuts of ``text``, ascending (see the module docstring).

        Each added-token cut, and the first plain-text cut at or after each multiple of
        ``plain_cut_chars``: positions ``p > 0`` where ``encode(text)`` splits exactly.
        """
        return sorted([*self.added_token_cuts(text), *self.plain_cuts(text, self.plain_cut_chars)])

    def added_token_cuts(self, text: str) -> list[int]:
        """Positions ``p > 0`` (ascending) where an added token starts, straddled by none."""
        rx = self._added
        if rx is None or self.unsupported is not None:
            return []
        out = []
        for m in rx.finditer(text):
            p = m.start()
            if p > 0 and not self._straddled(text, p):
                out.append(p)
        return out

    def plain_cuts(self, text: str, every: int = 1) -> list[int]:
        """The first plain-text cut at or after each multiple of ``every`` (ascending).

        Plain-text cuts are spaces followed by a letter where no added token starts; there
        are none when the tokenizer does not qualify (:func:`plain_cut_support`).
        """
        if self.plain_unsupported is not None:
            return []
        out = []
        pos = every
        while (m := _SPACE_LETTER.search(text, pos)) is not None:
            p = m.start()
            token_next = self._added is not None and self._added.match(text, p + 1) is not None
            if text[p + 1].isalpha() and not token_next:
                out.append(p)
                pos = (p // every + 1) * every
            else:
                pos = p + 1
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
        return the same ids. ``encode_batch_fast`` also skips computing offsets. One text
        per call: a batch of several spreads over every core, starving the event loop.
        """
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
            TypeError: ``text`` is not a str.
            PromptTooLongError: ``limit`` is set and the prompt has more tokens; counting
                stops as soon as that is known.
        """
        if not isinstance(text, str):
            raise TypeError(f"can only encode str, got {type(text).__name__}")
        if limit is not None and self.max_token_chars is not None:
            at_least = math.ceil(len(text) / self.max_token_chars)
            if at_least > limit:
                raise PromptTooLongError(at_least, exact=False)
        has_post = self.tokenizer.backend.post_processor is not None
        if not self.caching or (add_special_tokens and has_post):
            whole = self._encode(text, add_special_tokens)
            if limit is not None and len(whole) > limit:
                raise PromptTooLongError(len(whole), exact=True)
            return whole
        cuts = self.cuts(text)
        keys = self._keys(text, cuts)
        segments = self.cache.get_run(keys)
        ids: list[int] = []
        for cached in segments:
            ids.extend(cached)
        if limit is not None and len(ids) > limit:
            raise PromptTooLongError(len(ids), exact=False)
        # Segment j is text[bounds[j]:bounds[j + 1]]; the cache held the first len(segments).
        bounds = [0, *cuts, len(text)]
        for chunk in _chunks(bounds, len(segments)):
            for j in chunk:
                new = self._encode(text[bounds[j] : bounds[j + 1]], False)
                ids.extend(new)
                if j < len(cuts):
                    segments.append(array("I", new))
            if limit is not None and len(ids) > limit:
                raise PromptTooLongError(len(ids), exact=chunk[-1] == len(cuts))
        self.cache.put_run(keys, segments)
        return ids


def _chunks(bounds: list[int], first: int) -> Iterator[range]:
    """Segments ``first``, ``first + 1``... in runs of about :data:`CHUNK_CHARS` each.

    Segment ``j`` is ``bounds[j]:bounds[j + 1]``; the last run ends with the last segment.
    """
    start = first
    for j in range(first + 1, len(bounds)):
        if bounds[j] - bounds[start] >= CHUNK_CHARS or j == len(bounds) - 1:
            yield range(start, j)
            start = j
