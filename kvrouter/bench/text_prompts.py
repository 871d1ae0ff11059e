"""Text prompts of trace records that tokenize back to one token per word.

Peer routers (vllm-router's and sglang-router's ``cache_aware``) route on
prompt *text*, so a side-by-side replay must send text. To keep the trace's
prefix sharing intact after tokenization, each prompt token becomes one word
from a fixed list of words that the model's tokenizer maps to exactly one
token when preceded by a space::

    trace token ids (PromptFactory, vocab = len(words))  3  17  3  ...
    text                                                 " the pro the ..."
    tokenizer(text)                                      [260, 348, 260, ...]

A byte-level BPE pre-tokenizer splits ``" word"`` pieces apart before any
merge, so no merge crosses a word boundary: the text of a prompt tokenizes
to the concatenation of its words' ids, block boundaries stay where the
trace put them, and two records sharing ``k`` hash ids share ``k * 512``
tokens (hence KV blocks) on the worker. :meth:`TextPrompts.check` verifies
that with the real tokenizer.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvrouter.bench.trace import PromptFactory, TraceRecord

if TYPE_CHECKING:
    from engine_worker.tokenizer import Tokenizer

__all__ = ["TextPrompts", "single_token_words"]


def single_token_words(tokenizer: Tokenizer, limit: int = 8192) -> list[tuple[str, int]]:
    """Lower-case ASCII words (3+ letters) whose ``" " + word`` is one token, by token id.

    Ordered by token id, so the list (and every prompt built from it) is the
    same in every process that loads the same tokenizer.
    """
    vocab = tokenizer.backend.get_vocab()
    out: list[tuple[str, int]] = []
    for piece, tid in sorted(vocab.items(), key=lambda kv: kv[1]):
        word = piece[1:]
        if not (piece.startswith("\u0120") and len(word) >= 3 and word.isascii()):
            continue
        if not (word.isalpha() and word.islower()):
            continue
        if tokenizer.encode(" " + word, add_special_tokens=False) == [tid]:
            out.append((word, tid))
            if len(out) >= limit:
                break
    return out


class TextPrompts:
    """Prompt text of trace records, one single-token word per trace token.

    Args:
        tokenizer: The served model's tokenizer (the workers' and the gateway's).
        block_size: Tokens per KV block (for the token stream; keys are not needed).
        root: ``indexer.keys.root_parent(model)``.
        words: How many single-token words to draw prompts from.
    """

    def __init__(self, tokenizer: Tokenizer, block_size: int, root: int, *, words: int = 8192):
        self.tokenizer = tokenizer
        pairs = single_token_words(tokenizer, words)
        if len(pairs) < 2:
            raise ValueError("the tokenizer has fewer than 2 single-token words")
        self._words = [" " + w for w, _ in pairs]
        self._ids = [tid for _, tid in pairs]
        self._factory = PromptFactory(block_size, root, vocab_size=len(pairs))

    def text(self, record: TraceRecord) -> str:
        """The record's prompt as text (``input_length`` words)."""
        words = self._words
        return "".join(words[i] for i in self._factory.tokens(record))

    def token_ids(self, record: TraceRecord) -> list[int]:
        """The token ids the workers see for :meth:`text` (without a BOS the tokenizer adds)."""
        ids = self._ids
        return [ids[i] for i in self._factory.tokens(record)]

    def suffix(self, rng: random.Random, tokens: int) -> str:
        """``tokens`` random words (a unique tail for overhead probes)."""
        return "".join(rng.choice(self._words) for _ in range(tokens))

    def check(self, records: Sequence[TraceRecord]) -> None:
        """Raise if a record's text does not tokenize to exactly :meth:`token_ids`.

        Raises:
            ValueError: Naming the first record whose tokens differ.
        """
        for n, rec in enumerate(records):
            got = self.tokenizer.encode(self.text(rec), add_special_tokens=False)
            if got != self.token_ids(rec):
                raise ValueError(f"record {n}: its text does not tokenize back to its tokens")
