"""Token sampling from logits: greedy, temperature, top-k, top-p, per-request seeds.

A request with a ``seed`` owns a ``torch.Generator`` seeded once, so its
output is reproducible whatever else shares the batch; requests without a
seed share the sampler's generator.

One request's parameters must never stop the engine that samples for the whole
batch: temperatures too small to divide by are greedy (``SamplingParams.greedy``),
scores are shifted so that their maximum is 0 before the division, and a row
whose distribution still is not finite (logits with NaN in them) gets its argmax,
with a warning, instead of an exception in the engine loop.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from engine_worker.request import SamplingParams

__all__ = ["Sampler", "penalize"]

log = logging.getLogger(__name__)


class Sampler:
    """Samples one token per row of logits."""

    def __init__(self, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._seeded: dict[str, torch.Generator] = {}
        #: Per request, its prompt's distinct token ids (what a repetition penalty reads
        #: every step; a 100K-token prompt is not gone through again at each one).
        self._prompts: dict[str, torch.Tensor] = {}

    def forget(self, request_id: str) -> None:
        """Drop a finished request's generator and prompt ids."""
        self._seeded.pop(request_id, None)
        self._prompts.pop(request_id, None)

    def _prompt(self, request_id: str, p: SamplingParams, prompt: Sequence[int]) -> torch.Tensor:
        if p.repetition_penalty == 1.0:
            return _NONE
        ids = self._prompts.get(request_id)
        if ids is None:
            ids = torch.tensor(sorted(set(prompt)), dtype=torch.long)
            self._prompts[request_id] = ids
        return ids

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self.generator
        gen = self._seeded.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
            self._seeded[request_id] = gen
        return gen

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        request_ids: Sequence[str],
        tokens: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
    ) -> list[int]:
        """One token per row of ``logits`` ([n, vocab], float32).

        ``tokens``: each row's (prompt, output) token ids, which penalties read (needed
        when any row's parameters are ``penalized``).
        """
        if logits.shape[0] != len(params):
            raise ValueError("one SamplingParams per row of logits")
        if tokens is not None and len(tokens) != len(params):
            raise ValueError("one (prompt, output) pair per row of logits")
        greedy = logits.argmax(dim=-1)
        out: list[int] = greedy.tolist()
        for i, (p, rid) in enumerate(zip(params, request_ids, strict=True)):
            row = logits[i]
            if p.penalized:
                # A copy of this row only: the batch's other rows are read as they are.
                if tokens is None:
                    raise ValueError("penalties need each row's prompt and output token ids")
                row = row.float().clone()
                prompt, output = tokens[i]
                penalize(row, p, self._prompt(rid, p, prompt), output)
                if p.greedy:
                    out[i] = int(row.argmax())
            if p.greedy:
                continue
            sampled = self._sample_row(row, p, self._generator(rid, p))
            if sampled is None:
                log.warning("request %s: logits are not finite; took the argmax", rid)
                continue
            out[i] = sampled
        return out

    @staticmethod
    def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int | None:
        """The sampled token, or None when the row's distribution is not finite."""
        row = row.float()
        scores = (row - row.max()) / p.temperature
        if p.top_k > 0 and p.top_k < scores.shape[-1]:
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            probs = torch.softmax(sorted_scores, dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (always the first token).
            drop = probs.cumsum(dim=-1) - probs >= p.top_p
            sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
            scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
        probs = torch.softmax(scores, dim=-1)
        if not bool(torch.isfinite(probs).all()):
            return None
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return int(torch.multinomial(probs, 1, generator=gen).item())


#: No prompt ids (no repetition penalty to read them).
_NONE = torch.zeros(0, dtype=torch.long)


def penalize(
    row: torch.Tensor, p: SamplingParams, prompt: torch.Tensor, output: Sequence[int]
) -> None:
    """Apply ``p``'s logit bias and penalties to one row of logits, in place.

    ``prompt``: the prompt's distinct token ids (only the repetition penalty reads
    them). In vLLM's order: the bias first, then the repetition penalty on every token
    of the prompt and the output so far, then the frequency and presence penalties on the
    output's tokens, ``logit -= frequency * count + presence * (count > 0)`` (OpenAI's
    definition, ``platform.openai.com/docs/advanced-usage``, "Frequency and presence
    penalties").
    """
    vocab = row.shape[-1]
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], device=row.device)
        bias = torch.tensor([b for _, b in p.logit_bias], dtype=row.dtype, device=row.device)
        keep = ids < vocab
        row.index_add_(0, ids[keep], bias[keep])
    if p.repetition_penalty != 1.0 and (len(prompt) or output):
        both = torch.cat([prompt, torch.tensor(output, dtype=torch.long)]).to(row.device)
        seen = torch.unique(both)
        seen = seen[seen < vocab]
        picked = row[seen]
        rp = p.repetition_penalty
        row[seen] = torch.where(picked > 0, picked / rp, picked * rp)
    if (p.frequency_penalty or p.presence_penalty) and output:
        ids = torch.tensor(output, device=row.device)
        counts = torch.bincount(ids[ids < vocab], minlength=vocab).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
