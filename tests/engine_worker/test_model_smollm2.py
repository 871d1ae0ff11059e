"""SmolLM2-135M-Instruct: our GGUF loader, tokenizer and chat template against transformers.

transformers reads the same GGUF file (``hf_from_gguf``: its own config
parsing, dequantization and Q/K un-permutation) and builds its tokenizer
from the same file (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``).
One reference per module; each takes tens of seconds to build on 2 cores.

Tolerance on logits: max abs difference <= 1e-3 in float32 (30 layers;
logits span about +-30; the measured difference is ~2e-5).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine_worker.chat_template import ChatTemplate
from engine_worker.model.llama import LlamaModel
from engine_worker.model.registry import resolve, smollm2_gguf_path
from engine_worker.tokenizer import Tokenizer, load_tokenizer
from tests.engine_worker.model_refs import greedy_generate, hf_from_gguf, hf_logits, prefill_logits

pytestmark = pytest.mark.slow

LOGIT_TOL = 1e-3

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "List three primes."},
        {"role": "assistant", "content": "2, 3, 5."},
        {"role": "user", "content": "Now three more — über quickly 🙂"},
    ],
    [{"role": "user", "content": "def f(x):\n    return x  # explain\n"}],
    [{"role": "user", "content": "Explain in two sentences why the sky is blue."}],
]

STRINGS = [
    "Hello, world!",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\n\n\n",
    "naïve café — “quotes” 日本語のテキスト",
    "emoji 🙂👍🏽🧑‍💻 family 👨‍👩‍👧",
    "def f(x):\n    return x**2  # comment\n",
    "x = [1, 2, 3]; y = {'a': 10}",
    "numbers 12345 and 3.14159",
    "<|im_start|>user\nhi<|im_end|>\n",
    "I'm you're they'll DON'T",
    "Ünïcödé\u00a0nbsp\u200bzero-width",
    "मराठी العربية עברית",
    "\r\n\r\n    \n",
]


@pytest.fixture(scope="module")
def ours() -> LlamaModel:
    return resolve("smollm2").load()[1]


@pytest.fixture(scope="module")
def reference() -> torch.nn.Module:
    return hf_from_gguf(smollm2_gguf_path())


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def chat_ids(tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    return tokenizer.encode(ChatTemplate.for_tokenizer(tokenizer).render(messages))


def test_logits_match_transformers(
    ours: LlamaModel, reference: torch.nn.Module, tokenizer: Tokenizer
) -> None:
    ids = chat_ids(tokenizer, CONVERSATIONS[1])
    diff = (prefill_logits(ours, ids, block_size=16) - hf_logits(reference, ids)[-1]).abs().max()
    assert float(diff) <= LOGIT_TOL


def test_greedy_chat_reply_matches_transformers_generate(
    ours: LlamaModel, reference: torch.nn.Module, tokenizer: Tokenizer
) -> None:
    ids = chat_ids(tokenizer, CONVERSATIONS[3])
    mine = greedy_generate(ours, ids, max_new_tokens=32)
    assert len(mine) == 32  # no early EOS: all 32 steps are compared
    with torch.no_grad():
        generated = reference.generate(  # type: ignore[operator]
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
            max_new_tokens=32,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=2,
        )
    theirs = generated[0, len(ids) :].tolist()
    assert mine == theirs
    assert "blue" in tokenizer.decode(mine)


def test_token_ids_match_transformers(tokenizer: Tokenizer, hf_tokenizer: Any) -> None:
    for text in STRINGS:
        assert tokenizer.encode(text) == hf_tokenizer(text).input_ids, text


def test_known_divergence_whitespace_run_before_a_digit(
    tokenizer: Tokenizer, hf_tokenizer: Any
) -> None:
    """transformers' GGUF converter ignores ``tokenizer.ggml.pre = smollm`` (digits isolated
    first), so before a digit it splits a run of spaces that llama.cpp, and SmolLM2's own
    tokenizer.json, keep whole. We follow llama.cpp; this pins the difference down."""
    ours = tokenizer.encode("a  1")
    assert [tokenizer.backend.id_to_token(i) for i in ours] == ["a", "ĠĠ", "1"]
    assert hf_tokenizer("a  1").input_ids != ours
    assert hf_tokenizer.decode(ours) == "a  1"


def test_chat_template_matches_apply_chat_template(tokenizer: Tokenizer, hf_tokenizer: Any) -> None:
    template = ChatTemplate.for_tokenizer(tokenizer)
    for messages in CONVERSATIONS:
        expected = hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        assert template.render(messages) == expected
