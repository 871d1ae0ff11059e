"""Steady open-loop load on the gateway replicas, every request classified by how it ended.

Requests go out at a fixed rate whatever happens to earlier ones (open
loop: a fault cannot slow the client down and hide itself), round robin
over the replicas a load balancer would consider up. Each one is a
streaming ``/v1/completions`` with a token-id prompt built like a trace
replay (:class:`~kvrouter.bench.trace.PromptFactory`: a few shared 512-token
prefixes, then the request's own tokens), ``ignore_eos`` and usage asked.

How a request ended (:class:`Outcome`):

* ``ok``: every token asked for, then ``data: [DONE]``.
* ``failed_before_stream``: no token reached the client: an HTTP error
  status, a connection error, or an error event before the first token.
  The system could have retried it; the goal is 0.
* ``gateway_gone``: it went to a replica that was killed while it ran (no
  system can save a client talking to a dead process); counted apart.
* ``cut_clean``: tokens, then an error event and ``data: [DONE]``: a stream
  broken after it started, ended the way clients can handle.
* ``cut_unclean``: tokens, then the connection dropped or the stream ended
  without an error event and ``[DONE]``. Goal 0.
* ``incomplete``: ``[DONE]`` without an error but fewer tokens than asked
  (``ignore_eos`` makes that a silent truncation). Goal 0.

The generator runs its own event loop in a thread, so a test's synchronous
fault code (kills, restarts, proxy knobs) runs beside it; it also scrapes
``/metrics`` of the given URLs every second, as Prometheus would.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import httpx

from indexer.keys import root_parent
from kvrouter.bench.trace import HASH_BLOCK_TOKENS, PromptFactory, TraceRecord

__all__ = ["LoadGenerator", "LoadReport", "LoadShape", "Outcome", "RequestResult"]


class Outcome(StrEnum):
    """How one request ended (see the module docstring)."""

    OK = "ok"
    FAILED_BEFORE_STREAM = "failed_before_stream"
    GATEWAY_GONE = "gateway_gone"
    CUT_CLEAN = "cut_clean"
    CUT_UNCLEAN = "cut_unclean"
    INCOMPLETE = "incomplete"


@dataclass(frozen=True, slots=True)
class LoadShape:
    """What the load sends.

    Attributes:
        rate: Requests per second (open loop).
        shared_prefixes: Distinct shared prefixes the prompts start with.
        prefix_blocks: 512-token blocks of each shared prefix.
        own_tokens: Range of the request's own tokens after the prefix (inclusive).
        max_tokens: Range of tokens to generate (inclusive).
        seed: Seeds the choices and keeps each run's own tokens distinct.
    """

    rate: float = 12.0
    shared_prefixes: int = 8
    prefix_blocks: int = 1
    own_tokens: tuple[int, int] = (16, 160)
    max_tokens: tuple[int, int] = (16, 64)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.shared_prefixes < 1 or self.prefix_blocks < 0:
            raise ValueError("rate must be > 0, shared_prefixes >= 1, prefix_blocks >= 0")
        if not 1 <= self.own_tokens[0] <= self.own_tokens[1]:
            raise ValueError("own_tokens must be a range of positive counts")
        if not 1 <= self.max_tokens[0] <= self.max_tokens[1]:
            raise ValueError("max_tokens must be a range of positive counts")


@dataclass(slots=True)
class RequestResult:
    """One request's fate.

    Attributes:
        index: Its number in the run.
        gateway: The replica it went to.
        outcome: How it ended.
        sent_s: When it was sent, seconds since the load started.
        ended_s: When it ended, same clock.
        tokens: Token chunks received.
        max_tokens: Tokens asked for.
        status: HTTP status (0 without a response).
        worker: The worker the gateway named (``x-kvrouter-worker``), or "".
        detail: Why it did not end ``ok``.
    """

    index: int
    gateway: str
    outcome: Outcome = Outcome.OK
    sent_s: float = 0.0
    ended_s: float = 0.0
    tokens: int = 0
    max_tokens: int = 0
    status: int = 0
    worker: str = ""
    detail: str = ""


@dataclass(slots=True)
class LoadReport:
    """Every request of one run.

    Attributes:
        results: One per request sent, in sending order.
        duration_s: Seconds the load ran (sending).
        scrapes: /metrics scrapes done; ``scrape_errors`` of them failed.
    """

    results: list[RequestResult]
    duration_s: float
    scrapes: int = 0
    scrape_errors: int = 0

    def count(self, outcome: Outcome) -> int:
        """Requests that ended with ``outcome``."""
        return sum(r.outcome is outcome for r in self.results)

    def figures(self) -> dict[str, Any]:
        """JSON-ready counts, with up to five example details per non-ok outcome."""
        by = Counter(r.outcome for r in self.results)
        examples: dict[str, list[str]] = {}
        for r in self.results:
            if r.outcome is not Outcome.OK and len(examples.setdefault(r.outcome, [])) < 5:
                examples[r.outcome].append(
                    f"#{r.index} via {r.gateway} worker={r.worker or '?'} status={r.status} "
                    f"tokens={r.tokens}/{r.max_tokens} at {r.sent_s:.2f}-{r.ended_s:.2f}s: "
                    f"{r.detail}"
                )
        return {
            "requests": len(self.results),
            **{o.value: by.get(o, 0) for o in Outcome},
            "streams_cut": by.get(Outcome.CUT_CLEAN, 0) + by.get(Outcome.CUT_UNCLEAN, 0),
            "load_s": round(self.duration_s, 2),
            "per_worker": dict(Counter(r.worker or "?" for r in self.results)),
            "scrapes": self.scrapes,
            "scrape_errors": self.scrape_errors,
            "examples": examples,
        }


@dataclass(slots=True)
class _Stream:
    """What a streaming response delivered."""

    tokens: int = 0
    error: str = ""
    error_after_tokens: bool = False
    done: bool = False
    done_after_error: bool = False
    completion_tokens: int | None = None


@dataclass(slots=True)
class _Health:
    """The load balancer's view: replicas marked down, and how often each was killed."""

    down: set[str] = field(default_factory=set)
    kills: Counter[str] = field(default_factory=Counter)


class LoadGenerator:
    """Open-loop streaming load (see the module docstring); start/stop or a context manager.

    Args:
        gateways: Base URLs of the gateway replicas.
        shape: What to send.
        model: Model name in the requests.
        timeout_s: Longest silence on a connection before the request is given up.
        scrape: Base URLs whose ``/metrics`` are scraped every second meanwhile.
    """

    def __init__(
        self,
        gateways: Sequence[str],
        shape: LoadShape,
        *,
        model: str = "tiny",
        timeout_s: float = 30.0,
        scrape: Sequence[str] = (),
    ) -> None:
        if not gateways:
            raise ValueError("no gateway to send to")
        self.gateways = list(gateways)
        self.shape = shape
        self.model = model
        self.timeout_s = timeout_s
        self.scrape = list(scrape)
        self.results: list[RequestResult] = []
        self._health = _Health()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._factory = PromptFactory(16, root_parent(model))
        self._started = 0.0
        self._stopped = 0.0
        self._scrapes = self._scrape_errors = 0
        self._error: BaseException | None = None
        self._drain_s = 60.0

    # -- control (any thread) -------------------------------------------------------------------

    def start(self) -> LoadGenerator:
        """Start sending."""
        self._thread = threading.Thread(target=self._run, name="chaos-load", daemon=True)
        self._started = time.monotonic()
        self._thread.start()
        return self

    def stop(self, drain_s: float = 60.0) -> LoadReport:
        """Stop sending, wait up to ``drain_s`` for requests in flight, report."""
        if self._thread is None:
            raise RuntimeError("the load was not started")
        self._stopped = self._stopped or time.monotonic()
        self._drain_s = drain_s
        self._stop.set()
        self._thread.join(drain_s + self.timeout_s + 10)
        if self._error is not None:
            raise RuntimeError("the load generator failed") from self._error
        if self._thread.is_alive():
            raise RuntimeError("the load generator did not stop")
        return LoadReport(list(self.results), self._stopped - self._started, self._scrapes,
                          self._scrape_errors)  # fmt: skip

    def __enter__(self) -> LoadGenerator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.running:
            self.stop()

    def mark_down(self, gateway: str) -> None:
        """The replica is about to die: send it nothing new; what it holds is ``gateway_gone``."""
        self._health.kills[gateway] += 1
        self._health.down.add(gateway)

    def mark_up(self, gateway: str) -> None:
        """The replica is back: send to it again."""
        self._health.down.discard(gateway)

    @property
    def running(self) -> bool:
        """Whether it was started and not stopped."""
        return self._thread is not None and not self._stop.is_set()

    @property
    def elapsed_s(self) -> float:
        """Seconds since the load started."""
        return time.monotonic() - self._started

    def in_flight(self) -> int:
        """Requests sent and not finished."""
        return sum(r.ended_s == 0.0 for r in self.results)

    # -- the loop -------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:
            self._error = exc

    async def _main(self) -> None:
        rng = random.Random(self.shape.seed)
        timeout = httpx.Timeout(self.timeout_s, connect=5.0)
        limits = httpx.Limits(max_connections=2048, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
            scraper = asyncio.create_task(self._scraper(http)) if self.scrape else None
            tasks: set[asyncio.Task[None]] = set()
            t0 = time.monotonic()
            n = rr = 0
            while not self._stop.is_set():
                delay = t0 + n / self.shape.rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(min(delay, 0.05))
                    continue
                up = [g for g in self.gateways if g not in self._health.down]
                gateway = up[rr % len(up)] if up else self.gateways[rr % len(self.gateways)]
                rr += 1
                result = RequestResult(n, gateway, sent_s=time.monotonic() - self._started)
                self.results.append(result)
                body = self._body(rng, n)
                task = asyncio.create_task(self._one(http, body, result))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                n += 1
            if tasks:
                _, pending = await asyncio.wait(set(tasks), timeout=self._drain_s)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
            if scraper is not None:
                scraper.cancel()
                await asyncio.gather(scraper, return_exceptions=True)

    def _body(self, rng: random.Random, n: int) -> dict[str, Any]:
        s = self.shape
        own = rng.randint(*s.own_tokens)
        prefix = [rng.randrange(s.shared_prefixes) * 100 + b for b in range(s.prefix_blocks)]
        base = (s.seed + 1) * 10_000_000 + n * 100
        own_ids = [base + k for k in range(-(-own // HASH_BLOCK_TOKENS))]
        length = s.prefix_blocks * HASH_BLOCK_TOKENS + own
        record = TraceRecord(0.0, length, 1, [*prefix, *own_ids])
        return {
            "model": self.model,
            "prompt": self._factory.tokens(record),
            "max_tokens": rng.randint(*s.max_tokens),
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async def _one(self, http: httpx.AsyncClient, body: dict[str, Any], r: RequestResult) -> None:
        r.max_tokens = int(body["max_tokens"])
        kills_before = self._health.kills[r.gateway]
        got = _Stream()
        failure = ""
        try:
            async with http.stream("POST", f"{r.gateway}/v1/completions", json=body) as resp:
                r.status = resp.status_code
                r.worker = resp.headers.get("x-kvrouter-worker", "")
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    failure = f"HTTP {resp.status_code}: {text[:200]}"
                else:
                    async for line in resp.aiter_lines():
                        _read_event(line, got)
        except httpx.HTTPError as exc:
            failure = f"{type(exc).__name__}: {exc}"[:200]
        except asyncio.CancelledError:
            failure = "still running when the load stopped"
        finally:
            r.ended_s = time.monotonic() - self._started
            r.tokens = got.tokens
            gone = r.gateway in self._health.down or self._health.kills[r.gateway] != kills_before
            r.outcome, r.detail = _classify(got, failure, r.max_tokens, gone=gone)

    async def _scraper(self, http: httpx.AsyncClient) -> None:
        while True:
            for url in self.scrape:
                self._scrapes += 1
                try:
                    (await http.get(f"{url}/metrics", timeout=5.0)).raise_for_status()
                except httpx.HTTPError:
                    self._scrape_errors += 1
            await asyncio.sleep(1.0)


def _read_event(line: str, got: _Stream) -> None:
    """Fold one SSE line into ``got``."""
    if not line.startswith("data: "):
        return
    data = line[6:]
    if data == "[DONE]":
        got.done = True
        got.done_after_error = bool(got.error)
        return
    try:
        event = json.loads(data)
    except ValueError:
        got.error = got.error or f"not JSON: {data[:80]}"
        return
    if event.get("error"):
        err = event["error"]
        got.error = (err.get("message") if isinstance(err, dict) else str(err)) or "error event"
        got.error_after_tokens = got.tokens > 0
    elif event.get("choices"):
        got.tokens += 1
    if event.get("usage"):
        got.completion_tokens = int(event["usage"].get("completion_tokens", 0))


def _classify(got: _Stream, failure: str, max_tokens: int, *, gone: bool
              ) -> tuple[Outcome, str]:  # fmt: skip
    """The request's :class:`Outcome` and why (see the module docstring)."""
    clean_end = got.done and not failure
    if clean_end and not got.error and got.completion_tokens == max_tokens:
        return Outcome.OK, ""
    if gone:
        return Outcome.GATEWAY_GONE, failure or got.error or "replica killed"
    if got.tokens == 0:
        return Outcome.FAILED_BEFORE_STREAM, failure or got.error or "no token and no error"
    if got.error:
        if got.done_after_error and not failure:
            return Outcome.CUT_CLEAN, got.error[:200]
        return Outcome.CUT_UNCLEAN, f"error event, then {failure or 'no [DONE]'}: {got.error}"
    if not clean_end:
        return Outcome.CUT_UNCLEAN, failure or "stream ended without [DONE]"
    return Outcome.INCOMPLETE, f"[DONE] after {got.completion_tokens} of {max_tokens} tokens"
