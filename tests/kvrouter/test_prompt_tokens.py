"""Prompt tokenization in the gateway: the prefix cache is exact, and big prompts don't block."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_worker.chat_template import ChatTemplate
from engine_worker.tokenizer import Tokenizer, load_tokenizer
from kvrouter.gateway.prompt_tokens import PromptTokenizer, PromptTooLongError
from tests.support.cluster import Cluster, run_cluster

SPECS = ["tiny", "smollm2"]
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_", "im_end|>", "<", "|>"]

# Unicode (emoji, combining marks, CJK), whitespace runs, digits, and pieces of the
# special tokens: the text a cut could go wrong on.
_alphabet = st.one_of(
    st.characters(codec="utf-8", exclude_categories=["Cs"]),
    st.sampled_from([" ", "  ", "\n", "\n\n", "\t", "\r\n", "😀", "👩‍👩‍👧", "é", "e\u0301", "123"]),
    st.sampled_from(SPECIAL),
)
_text = st.lists(_alphabet, max_size=40).map("".join)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": _text}
)


def _tokenizer(spec: str) -> tuple[Tokenizer, ChatTemplate]:
    tok = load_tokenizer(spec)
    return tok, ChatTemplate.for_tokenizer(tok)


@pytest.mark.parametrize("spec", SPECS)
def test_the_models_tokenizers_can_be_cut_at_added_tokens(spec: str) -> None:
    assert PromptTokenizer(load_tokenizer(spec)).caching


@pytest.mark.parametrize("spec", SPECS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=st.lists(_message, min_size=1, max_size=8), turns=st.integers(1, 4))
def test_chat_turns_tokenize_from_the_cache_exactly_as_whole(
    spec: str, history: list[dict[str, str]], turns: int
) -> None:
    tok, template = _tokenizer(spec)
    prompts = PromptTokenizer(tok)
    for k in range(1, len(history) + 1):
        for generation in (True, False)[: turns % 2 + 1]:
            text = template.render(history[:k], add_generation_prompt=generation)
            whole = tok.encode(text, add_special_tokens=False)
            assert prompts.encode(text, add_special_tokens=False) == whole


@pytest.mark.parametrize("spec", SPECS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(_text, min_size=1, max_size=6))
def test_plain_prompts_that_extend_earlier_ones_tokenize_exactly_as_whole(
    spec: str, pieces: list[str]
) -> None:
    tok = load_tokenizer(spec)
    prompts = PromptTokenizer(tok)
    text = ""
    for piece in pieces:
        text += piece
        assert prompts.encode(text) == tok.encode(text)
        assert prompts.encode(text) == tok.encode(text)  # the second time from the cache


def test_a_follow_up_turn_tokenizes_only_its_new_text() -> None:
    tok, template = _tokenizer("tiny")
    prompts = PromptTokenizer(tok)
    history = [{"role": "user", "content": "tell me a story " * 500}]
    first = template.render(history)
    prompts.encode(first, add_special_tokens=False)
    history += [{"role": "assistant", "content": "Once upon a time."}]
    history += [{"role": "user", "content": "And then?"}]
    follow = template.render(history)
    hits = prompts.cache.hits
    assert prompts.encode(follow, add_special_tokens=False) == tok.encode(
        follow, add_special_tokens=False
    )
    assert prompts.cache.hits == hits + 1
    # What was tokenized is the text after the first turn's cached prefix.
    cached_chars = first.rindex("<|im_start|>")
    assert len(follow) - cached_chars < len(follow) // 50


def test_the_cache_stays_within_its_byte_budget() -> None:
    tok, template = _tokenizer("tiny")
    prompts = PromptTokenizer(tok, cache_bytes=64 * 1024)
    for i in range(200):
        chat = [{"role": "user", "content": f"conversation {i} " * 100}]
        prompts.encode(template.render(chat), add_special_tokens=False)
        assert prompts.cache.size_bytes <= 64 * 1024
    assert 0 < len(prompts.cache) < 200


def test_a_prompt_over_the_limit_is_refused_before_all_of_it_is_tokenized() -> None:
    tok, template = _tokenizer("tiny")
    prompts = PromptTokenizer(tok)
    # Many turns: counting stops at the chunk that crosses the limit, not at the end.
    chat = [{"role": "user", "content": "word " * 20_000} for _ in range(40)]
    with pytest.raises(PromptTooLongError) as refused:
        prompts.encode(template.render(chat), add_special_tokens=False, limit=50_000)
    assert 50_000 < refused.value.at_least < 40 * 20_000
    assert not refused.value.exact
    # Longer than the limit times the longest token: refused without tokenizing at all.
    assert prompts.max_token_chars is not None
    with pytest.raises(PromptTooLongError) as bound:
        prompts.encode("x" * (prompts.max_token_chars * 100 + 1), limit=100)
    assert bound.value.at_least == 101


# -- the event loop keeps serving while a big prompt is tokenized -------------------------------


@pytest.fixture(scope="module")
def cluster(redis_server: Any) -> Iterator[Cluster]:
    redis_server.start()
    with run_cluster(redis_server.url, workers=1, gateway={"max_prompt_tokens": 100_000}) as c:
        yield c


def test_a_one_mib_prompt_does_not_stall_short_requests(cluster: Cluster) -> None:
    short = {"model": "tiny", "prompt": "Hello there", "max_tokens": 1}
    # Words on lines of their own: no space before a letter, so no cut inside the text,
    # and the whole MiB is tokenized before the limit can refuse it (spaced words would be
    # refused after the first chunk, too soon to show that nothing waited for it).
    big = {
        "model": "tiny",
        "prompt": "lorem\nipsum\ndolor\n" * (1024 * 1024 // 18),
        "max_tokens": 1,
    }

    async def timed(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[float, float, int]:
        """(latency, finish time, status) of one request."""
        t0 = time.perf_counter()
        r = await client.post(f"{cluster.gateway}/v1/completions", json=body)
        done = time.perf_counter()
        return done - t0, done, r.status_code

    async def run() -> tuple[float, list[tuple[float, float, int]], tuple[float, float, int]]:
        async with httpx.AsyncClient(timeout=60) as client:
            unloaded = sorted([(await timed(client, short))[0] for _ in range(11)])[5]
            task = asyncio.create_task(timed(client, big))
            await asyncio.sleep(0.05)  # the big request's body is on its way first
            smalls = [await timed(client, short) for _ in range(5)]
            return unloaded, smalls, await task

    unloaded, smalls, (_, big_done, big_status) = asyncio.run(run())
    # ~300K tokens, over the limit: a 400, once the whole text is tokenized (in a thread).
    assert big_status == 400
    assert all(status == 200 for *_, status in smalls)
    # The short requests did not wait for the big one: all done before it, each within a
    # small multiple of its unloaded latency.
    assert max(done for _, done, _ in smalls) < big_done
    assert sorted(s for s, _, _ in smalls)[2] < 20 * unloaded
