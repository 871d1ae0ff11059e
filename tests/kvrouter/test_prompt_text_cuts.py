"""Plain-text cuts: exact wherever they are made, and a long shared prefix comes from the cache."""

from __future__ import annotations

import functools
import json
import random
from typing import Any, cast

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Encoding
from tokenizers import Tokenizer as Backend

from engine_worker.tokenizer import Tokenizer, load_tokenizer
from kvrouter.gateway.prompt_tokens import (
    PLAIN_CUT_CHARS,
    PromptTokenizer,
    PromptTooLongError,
    plain_cut_support,
)

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BYTE_LEVEL = {
    "type": "ByteLevel",
    "add_prefix_space": False,
    "trim_offsets": True,
    "use_regex": True,
}

#: SmolLM2's tokenizer with other pre-tokenizers: name -> pre-tokenizer spec.
_PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    "digit-runs": {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": False}, _BYTE_LEVEL],
    },
    "byte-level": _BYTE_LEVEL,
    "llama3-split": {
        "type": "Sequence",
        "pretokenizers": [
            {
                "type": "Split",
                "pattern": {"Regex": _LLAMA3},
                "behavior": "Isolated",
                "invert": False,
            },
            {**_BYTE_LEVEL, "use_regex": False},
        ],
    },
    "whitespace": {"type": "Whitespace"},
    "prefix-space": {**_BYTE_LEVEL, "add_prefix_space": True},
}
#: SmolLM2's tokenizer with one more added token: name -> its text.
_ADDED = {"word-token": "hello", "spaced-token": "hello world"}
_QUALIFYING = ["smollm2", "digit-runs", "byte-level", "word-token"]


@functools.cache
def _tokenizer(name: str) -> Tokenizer:
    """SmolLM2's tokenizer with the pre-tokenizer or the added token ``name``."""
    base = load_tokenizer("smollm2")
    if name == "smollm2":
        return base
    spec = json.loads(base.backend.to_str())
    spec["pre_tokenizer"] = _PRE_TOKENIZERS.get(name, spec["pre_tokenizer"])
    backend = Backend.from_str(json.dumps(spec))
    if name in _ADDED:
        backend.add_tokens([AddedToken(_ADDED[name])])
    return Tokenizer(backend, bos_token=None, eos_token=None, eos_token_ids=(), chat_template=None)


@functools.cache
def _prompts(name: str, every: int = 1, cache_bytes: int = 64 * 1024 * 1024) -> PromptTokenizer:
    """One PromptTokenizer per setting (building one reads the whole tokenizer spec)."""
    return PromptTokenizer(_tokenizer(name), cache_bytes, plain_cut_chars=every)


class _CountingBackend:
    """A tokenizer backend that counts the characters it is asked to tokenize."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.chars = 0

    def encode_batch_fast(self, texts: list[str], add_special_tokens: bool) -> list[Encoding]:
        self.chars += sum(map(len, texts))
        return self.backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


def _counting(cache_bytes: int = 64 * 1024 * 1024) -> tuple[PromptTokenizer, _CountingBackend]:
    """A PromptTokenizer for SmolLM2, and the counter of what it hands the tokenizer."""
    counter = _CountingBackend(load_tokenizer("smollm2").backend)
    tok = Tokenizer(
        cast(Backend, counter), bos_token=None, eos_token=None, eos_token_ids=(), chat_template=None
    )
    return PromptTokenizer(tok, cache_bytes), counter


#: Words, numbers and punctuation of the documents, some glued (a tab, an apostrophe).
_WORDS = (
    "the of and to in is that it was for on are as with his they at one have this from Paris "
    "naïve don't we'll 1998 3.5% (see note) end. «quote» über résumé 東京 — x\ty"
)


def _document(words: int, seed: int) -> str:
    """Plain prose-like text of ``words`` words."""
    rng = random.Random(seed)
    vocab = _WORDS.split(" ")
    return " ".join(rng.choice(vocab) for _ in range(words))


# Words (any script), whitespace runs, contractions and punctuation, numbers of any kind,
# emoji, combining marks, any character, and pieces of the special tokens.
_word = st.one_of(
    st.sampled_from(["the", "cat", "I", "Don", "x", "naïve", "Straße", "日本", "мир", "ǅ", "ʰ"]),
    st.text(st.characters(categories=["L"]), min_size=1, max_size=6),
)
_gap = st.sampled_from(
    [" ", " ", "  ", "   ", "\t", " \t ", "\n", "\n\n", " \n ", "\r\n", "\u00a0", "\u3000", "\x85"]
)
_mark = st.sampled_from(
    ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'", "'S", "’s", "n't", ".", ",", "!?", "—", "("]
)
_number = st.one_of(
    st.integers(0, 10**6).map(str), st.sampled_from(["²", "½", "٣", "Ⅻ", "〇", "3.14", "_"])
)
_odd = st.one_of(
    st.sampled_from(["😀", "👩‍👩‍👧", "e\u0301", "\u0301", "\u200b", "\ufeff"]),
    st.characters(codec="utf-8", exclude_categories=["Cs"]),
)
_special = st.sampled_from(["<|im_start|>", "<|im_end|>", "<|im_", "im_end|>", "<", "|>", "hello"])
_plain = st.lists(st.one_of(_word, _word, _gap, _gap, _mark, _number, _odd), max_size=50)
_mixed = st.lists(st.one_of(_word, _word, _gap, _gap, _mark, _number, _odd, _special), max_size=50)


@pytest.mark.parametrize("spec", ["tiny", "smollm2"])
def test_the_models_tokenizers_can_be_cut_inside_plain_text(spec: str) -> None:
    assert plain_cut_support(load_tokenizer(spec)) is None


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("llama3-split", "not GPT-2's byte-level regex"),
        ("whitespace", "not GPT-2's byte-level regex"),
        ("prefix-space", "does not split pieces independently"),
        ("spaced-token", "an added token contains a space"),
    ],
)
def test_other_tokenizers_are_not_cut_inside_plain_text(name: str, why: str) -> None:
    reason = plain_cut_support(_tokenizer(name))
    assert reason is not None
    assert why in reason
    prompts = _prompts(name)
    text = "a plain prompt, with words " * 100
    assert prompts.plain_cuts(text) == []
    assert prompts.encode(text) == _tokenizer(name).encode(text)


@pytest.mark.parametrize("name", _QUALIFYING)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=_mixed)
# Where a space before something other than a letter is no cut: after whitespace, the
# piece before a digit or an added token ends in one whitespace run.
@example(pieces=["a", "  ", "²"])
@example(pieces=["a", "\t ", "7"])
@example(pieces=["a", "  ", "hello"])
@example(pieces=["a", "\u00a0 ", "<|im_end|>"])
def test_every_plain_text_cut_splits_the_ids_exactly(name: str, pieces: list[str]) -> None:
    text = "".join(pieces)
    tok = _tokenizer(name).backend
    cuts = _prompts(name).plain_cuts(text)
    halves = [t for p in cuts for t in (text[:p], text[p:])]
    whole, *parts = tok.encode_batch_fast([text, *halves], add_special_tokens=False)
    for k, p in enumerate(cuts):
        assert parts[2 * k].ids + parts[2 * k + 1].ids == whole.ids, p


def test_every_letter_after_a_space_starts_a_pre_token() -> None:
    # After whitespace, after a letter and after punctuation: each way a pre-token can end
    # at the space. The tokenizer's own character classes decide, for every letter Python
    # knows, whether the cut rule holds.
    letters = [chr(c) for c in range(0x110000) if chr(c).isalpha()]
    text = "".join(f"\t {c}x {c}. {c}" for c in letters)
    spaces = [p for p, ch in enumerate(text) if ch == " "]
    pre = load_tokenizer("smollm2").backend.pre_tokenizer
    starts = {start for _, (start, _) in pre.pre_tokenize_str(text)}
    assert [p for p in spaces if p not in starts] == []
    assert _prompts("smollm2").plain_cuts(text) == spaces


@pytest.mark.parametrize("name", _QUALIFYING)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    first=_plain,
    steps=st.lists(
        st.tuples(st.one_of(st.just(1.0), st.floats(0, 1)), st.one_of(_plain, _mixed)),
        min_size=1,
        max_size=5,
    ),
    every=st.sampled_from([1, 5, 40]),
    cache_bytes=st.sampled_from([1024, 64 * 1024 * 1024]),
)
def test_plain_prompts_that_extend_or_diverge_tokenize_from_the_cache_exactly_as_whole(
    name: str,
    first: list[str],
    steps: list[tuple[float, list[str]]],
    every: int,
    cache_bytes: int,
) -> None:
    tok = _tokenizer(name)
    prompts = _prompts(name, every, cache_bytes)
    prompts.cache.clear()
    text = "".join(first)
    assert prompts.encode(text) == tok.encode(text)
    for keep, new in steps:
        text = text[: round(len(text) * keep)] + "".join(new)
        assert prompts.encode(text) == tok.encode(text)
        assert prompts.encode(text) == tok.encode(text)  # the second time from the cache
        assert prompts.cache.size_bytes <= cache_bytes


@pytest.mark.parametrize("earlier", ["the shared text", "the shared text and more"])
def test_a_long_plain_prompt_sharing_a_prefix_tokenizes_little_more_than_its_new_text(
    earlier: str,
) -> None:
    prompts, counter = _counting()
    shared = _document(12_000, seed=1)
    before = shared if earlier == "the shared text" else f"{shared} {_document(2_000, seed=2)}"
    prompts.encode(before)
    follow = f"{shared} {_document(4_000, seed=3)}"
    hits, counter.chars = prompts.cache.hits, 0
    assert prompts.encode(follow) == load_tokenizer("smollm2").encode(follow)
    assert prompts.cache.hits == hits + 1
    # At most one spacing of plain-text cuts of the shared text is tokenized again.
    new = len(follow) - len(shared)
    assert new <= counter.chars <= new + PLAIN_CUT_CHARS + 64
    assert counter.chars < len(follow) // 3


def test_a_plain_prompt_over_the_limit_is_refused_before_all_of_it_is_tokenized() -> None:
    prompts, counter = _counting()
    text = "word " * 400_000
    with pytest.raises(PromptTooLongError) as refused:
        prompts.encode(text, limit=50_000)
    assert 50_000 < refused.value.at_least < 400_000
    assert not refused.value.exact
    assert counter.chars < len(text) // 4


def test_a_prompt_bigger_than_the_cache_keeps_the_head_of_its_chain() -> None:
    prompts, counter = _counting(cache_bytes=64 * 1024)
    text = _document(30_000, seed=4)
    prompts.encode(text)
    assert 0 < prompts.cache.size_bytes <= 64 * 1024
    hits, counter.chars = prompts.cache.hits, 0
    assert prompts.encode(text) == load_tokenizer("smollm2").encode(text)
    # The least recently used order dropped the chain's tail: its head still serves.
    assert prompts.cache.hits == hits + 1
    assert counter.chars < len(text) * 0.9
