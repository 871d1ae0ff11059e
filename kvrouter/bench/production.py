"""Workloads shaped like production traffic: heavy-tailed long prompts, growing sessions, bursts.

The generated chat, groups and agent workloads (:mod:`kvrouter.bench.workloads`)
have light-tailed lengths and Poisson arrivals. Production traces do not:

* **Lengths.** Mooncake's FAST'25 trace release (``kvcache-ai/Mooncake``,
  ``FAST25-release/README.md``, "Workloads") reports a conversation trace of
  12,031 requests averaging 12,035 input and 343 output tokens, and a
  tool-and-agent trace averaging 8,596 input and 182 output tokens, with
  prompts past 100K tokens; the first release's README states "up to 50%
  cache hit ratio". Azure's 2024 conversation trace
  (``Azure/AzurePublicDataset``, ``AzureLLMInferenceDataset2024``) has a mean
  output of 106 tokens with a median of 41: output lengths are heavy-tailed
  too. Lengths here are log-normal (median and sigma), truncated to the
  context.
* **Arrivals.** BurstGPT (Wang et al., arXiv 2401.17644) fits request
  inter-arrival times with a Gamma distribution rather than an exponential;
  its released generator's default shape is 0.5 (coefficient of variation
  1/sqrt(0.5) = 1.4, against 1 for Poisson). Session and request starts here
  are a Gamma renewal process of the given mean rate and shape.
* **Sessions.** Follow-up turns re-send the whole history plus the answer and
  a new message. Inter-turn gaps in a chatbot trace (Alibaba's
  qwen-bailian traces, Wang et al., "KVCache Cache in the Wild", USENIX
  ATC'25) sit around 7 s at the median and 43 s at p99 after the answer:
  log-normal, median 7 s, sigma 0.75. A turn arrives after the previous one
  by the answer's own duration (``output x answer_token_s``) plus that think
  time; the replay's time scale compresses both, as it does for the trace's
  timestamps.
* **Sharing.** Most reuse in the wild is within a session or through a shared
  system prompt (same paper: about 10% of blocks take most reuses); documents
  shared across users add a long shared prefix. System prompts and documents
  are picked by Zipf popularity (exponent 1).

Two families:

* :class:`ConversationWorkload` (``conversation``) -- multi-turn sessions, each
  opening with an app's system prompt, sometimes a shared document, and a
  first message that is occasionally a long paste; defaults fitted to the
  Mooncake conversation trace. Seeds 1 and 2 measure: 1,625 and 1,568 requests,
  mean prompt 13.9K and 13.5K tokens (median ~5K, p99 77K-122K, max 122K-131K),
  mean output ~340 (median ~230), inter-arrival CV 1.8-2.7, and an infinite
  prefix cache serving 60% of prompt blocks (within-session history counts,
  which is most of it).
* :class:`MixedWorkload` (``mixed``) -- API-style single requests: many short
  prompts behind shared system prompts arriving together with long document
  prompts (32K-128K) over a set of shared documents, in bursts; the mix that
  lets a few long prefills block a worker while short requests queue behind
  (seeds 1 and 2: mean prompt 6.4K and 9.3K, median 2K, p99 85K-128K).

Every length and gap is drawn from :class:`random.Random` (stable across
Python versions), so the same workload and seed give the same trace.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvrouter.bench.streams import TokenStream, WorkloadError, check_positive, shared_stream
from kvrouter.bench.trace import HASH_BLOCK_TOKENS, TraceRecord

__all__ = [
    "ConversationWorkload",
    "LogNormal",
    "MixedWorkload",
    "generate_conversation",
    "generate_mixed",
    "think_time",
]


@dataclass(frozen=True, slots=True)
class LogNormal:
    """A log-normal length or duration: ``median * exp(sigma * N(0, 1))`` clipped to [low, high]."""

    median: float
    sigma: float
    low: float = 1.0
    high: float = math.inf

    def __post_init__(self) -> None:
        check_positive(median=self.median, low=self.low)
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise WorkloadError(f"sigma must be >= 0, got {self.sigma}")
        if not self.high >= self.low:
            raise WorkloadError(f"high ({self.high}) must be >= low ({self.low})")

    def draw(self, rng: random.Random) -> float:
        """One value."""
        return min(max(rng.lognormvariate(math.log(self.median), self.sigma), self.low), self.high)

    def tokens(self, rng: random.Random) -> int:
        """One value rounded to a whole token count (at least ``low``)."""
        return max(round(self.draw(rng)), math.ceil(self.low))


def think_time(median_s: float, sigma: float) -> LogNormal:
    """Log-normal think time between a session's turns, clipped to [1 s, max(10 min,
    20 x its median)]."""
    return LogNormal(median_s, sigma, 1.0, max(600.0, 20.0 * median_s))


#: A chatbot trace's think time (Alibaba, ATC'25; the module docstring).
CHAT_THINK_TIME = think_time(7.0, 0.75)


def _gamma_gaps(rng: random.Random, rate: float, shape: float) -> Callable[[], float]:
    """Inter-arrival gaps of a Gamma renewal process with mean ``1 / rate``."""
    scale = 1.0 / (rate * shape)
    return lambda: rng.gammavariate(shape, scale)


def _zipf(rng: random.Random, n: int, exponent: float) -> Callable[[], int]:
    """Draws item ``i`` of ``n`` with probability proportional to ``1 / (i + 1) ** exponent``."""
    cum = list(itertools.accumulate(1.0 / (i + 1) ** exponent for i in range(n)))
    population = range(n)
    return lambda: rng.choices(population, cum_weights=cum)[0]


def _whole_blocks(tokens: int) -> int:
    """``tokens`` rounded up to whole 512-token hash blocks, so shared text shares exactly."""
    return -(-tokens // HASH_BLOCK_TOKENS) * HASH_BLOCK_TOKENS


def _check_share(**values: float) -> None:
    for name, value in values.items():
        if not 0.0 <= value <= 1.0:
            raise WorkloadError(f"{name} must be in [0, 1], got {value}")


@dataclass(frozen=True, slots=True)
class ConversationWorkload:
    """Multi-turn sessions with heavy-tailed first prompts (see the module docstring).

    Attributes:
        sessions: Sessions in the trace.
        session_rate: Sessions started per second (mean).
        arrival_shape: Gamma shape of the gaps between session starts (1: Poisson).
        turns_mean: Mean turns per session (geometric, at least one).
        max_turns: Turns per session at most.
        apps: Distinct system prompts, picked by Zipf popularity.
        system_tokens: Length of each app's system prompt (rounded up to whole 512 blocks).
        documents: Distinct shared documents, picked by Zipf popularity.
        document_share: Share of sessions that open with a shared document.
        document_tokens: Length of a shared document.
        paste_share: Share of sessions whose first message is a long paste of its own.
        paste_tokens: Length of such a paste.
        user_tokens: Length of a typed user message.
        answer_tokens: Length of an answer (the turn's ``output_length``).
        think_time_s: Time from an answer to the next message.
        answer_token_s: Seconds per answer token used to space turns (the answer's duration).
        max_context: A session ends before its prompt plus answer would exceed this.
        popularity: Zipf exponent of app and document popularity.
        horizon_s: The trace is a window of this many seconds, as a production trace
            is an hour of traffic: turns that would arrive later are not in it (the
            default, no limit, keeps every session whole). With think times of minutes,
            a window keeps the arrival rate steady instead of trailing off in the
            sessions' last turns long after the last session started.
    """

    sessions: int = 900
    session_rate: float = 1.0
    arrival_shape: float = 0.5
    turns_mean: float = 1.8
    max_turns: int = 24
    apps: int = 8
    system_tokens: int = 1536
    documents: int = 200
    document_share: float = 0.12
    document_tokens: LogNormal = LogNormal(24_000, 0.8, 2_048, 120_000)
    paste_share: float = 0.5
    paste_tokens: LogNormal = LogNormal(8_500, 1.0, 512, 120_000)
    user_tokens: LogNormal = LogNormal(200, 1.0, 8, 8_000)
    answer_tokens: LogNormal = LogNormal(240, 0.9, 8, 4_096)
    think_time_s: LogNormal = CHAT_THINK_TIME
    answer_token_s: float = 0.03
    max_context: int = 131_072
    popularity: float = 1.0
    horizon_s: float = math.inf

    def __post_init__(self) -> None:
        if not self.horizon_s > 0:
            raise WorkloadError(f"horizon_s must be > 0, got {self.horizon_s}")
        check_positive(
            sessions=self.sessions,
            session_rate=self.session_rate,
            arrival_shape=self.arrival_shape,
            apps=self.apps,
            documents=self.documents,
            max_turns=self.max_turns,
            max_context=self.max_context,
        )
        if not (math.isfinite(self.turns_mean) and self.turns_mean >= 1):
            raise WorkloadError(f"turns_mean must be >= 1, got {self.turns_mean}")
        _check_share(document_share=self.document_share, paste_share=self.paste_share)
        if self.system_tokens < 0 or self.answer_token_s < 0 or self.popularity < 0:
            raise WorkloadError("system_tokens, answer_token_s and popularity must be >= 0")
        longest_first = _whole_blocks(self.system_tokens) + self.document_tokens.high
        if longest_first + self.user_tokens.low + self.answer_tokens.low > self.max_context:
            raise WorkloadError("max_context cannot hold a system prompt and a document")


@dataclass(frozen=True, slots=True)
class MixedWorkload:
    """Single requests, short and very long at once, in bursts (see the module docstring).

    Attributes:
        requests: Requests in the trace.
        rate: Requests per second (mean).
        arrival_shape: Gamma shape of the gaps between requests (1: Poisson).
        apps: Distinct system prompts of short requests, picked by Zipf popularity.
        system_tokens: Length of each app's system prompt (rounded up to whole 512 blocks).
        user_tokens: Length of a short request's own part.
        long_share: Share of requests that ask about a long shared document.
        documents: Distinct documents, picked by Zipf popularity.
        document_tokens: Length of a document.
        question_tokens: Length of the question after a document.
        output_tokens: Length of an answer.
        popularity: Zipf exponent of app and document popularity.
    """

    requests: int = 3000
    rate: float = 4.0
    arrival_shape: float = 0.3
    apps: int = 16
    system_tokens: int = 1024
    user_tokens: LogNormal = LogNormal(900, 1.0, 8, 16_000)
    long_share: float = 0.1
    documents: int = 120
    document_tokens: LogNormal = LogNormal(40_000, 0.6, 16_384, 126_000)
    question_tokens: LogNormal = LogNormal(150, 0.8, 8, 2_000)
    output_tokens: LogNormal = LogNormal(150, 1.0, 4, 4_096)
    popularity: float = 1.0

    def __post_init__(self) -> None:
        check_positive(
            requests=self.requests,
            rate=self.rate,
            arrival_shape=self.arrival_shape,
            apps=self.apps,
            documents=self.documents,
        )
        _check_share(long_share=self.long_share)
        if self.system_tokens < 0 or self.popularity < 0:
            raise WorkloadError("system_tokens and popularity must be >= 0")


def _systems(alloc: Callable[[], int], apps: int, tokens: int) -> list[TokenStream]:
    return [shared_stream(alloc, _whole_blocks(tokens)) for _ in range(apps)]


def _documents(
    rng: random.Random,
    alloc: Callable[[], int],
    bases: Sequence[TokenStream],
    count: int,
    length: LogNormal,
) -> list[TokenStream]:
    """Shared documents, document ``d`` behind system prompt ``d mod len(bases)``."""
    return [
        shared_stream(alloc, _whole_blocks(length.tokens(rng)), bases[d % len(bases)])
        for d in range(count)
    ]


def generate_conversation(
    w: ConversationWorkload, rng: random.Random, alloc: Callable[[], int]
) -> list[TraceRecord]:
    """The sessions of ``w`` as trace records (unsorted)."""
    systems = _systems(alloc, w.apps, w.system_tokens)
    documents = _documents(rng, alloc, systems, w.documents, w.document_tokens)
    app, doc = _zipf(rng, w.apps, w.popularity), _zipf(rng, w.documents, w.popularity)
    gap = _gamma_gaps(rng, w.session_rate, w.arrival_shape)
    go_on = 1.0 - 1.0 / w.turns_mean
    out: list[TraceRecord] = []
    start = 0.0
    for _ in range(w.sessions):
        start += gap()
        if rng.random() < w.document_share:
            stream = documents[doc()].fork()
        else:
            stream = systems[app()].fork()
        first = w.paste_tokens.tokens(rng) if rng.random() < w.paste_share else 0
        message = first + w.user_tokens.tokens(rng)
        at = start
        for _ in range(w.max_turns):
            answer = w.answer_tokens.tokens(rng)
            if stream.length + message + answer > w.max_context:
                break
            stream.append(message)
            if at <= w.horizon_s:
                # Past the window the turn still happens (the draws and hash ids stay
                # those of the whole trace); it is only not recorded.
                out.append(stream.record(at, answer))
            stream.append(answer)
            if rng.random() >= go_on:
                break
            at += answer * w.answer_token_s + w.think_time_s.draw(rng)
            message = w.user_tokens.tokens(rng)
    return out


def generate_mixed(
    w: MixedWorkload, rng: random.Random, alloc: Callable[[], int]
) -> list[TraceRecord]:
    """The requests of ``w`` as trace records (in arrival order)."""
    systems = _systems(alloc, w.apps, w.system_tokens)
    documents = _documents(rng, alloc, systems, w.documents, w.document_tokens)
    app, doc = _zipf(rng, w.apps, w.popularity), _zipf(rng, w.documents, w.popularity)
    gap = _gamma_gaps(rng, w.rate, w.arrival_shape)
    out: list[TraceRecord] = []
    at = 0.0
    for _ in range(w.requests):
        at += gap()
        if rng.random() < w.long_share:
            stream = documents[doc()].fork()
            stream.append(w.question_tokens.tokens(rng))
        else:
            stream = systems[app()].fork()
            stream.append(w.user_tokens.tokens(rng))
        out.append(stream.record(at, w.output_tokens.tokens(rng)))
    return out
