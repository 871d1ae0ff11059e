"""Per-client rate limits shared by gateway replicas, and SLO-aware admission.

Rate limits are generic cell rate (GCRA) buckets, one for requests and one
for tokens (prompt + ``max_tokens``) per API key, kept in Redis so that
every replica draws on the same budget::

    {p}:rl:{{client}}:req  string   theoretical arrival time (s, Redis clock; PX expiry)
    {p}:rl:{{client}}:tok  string   the same for tokens

One Lua call checks both buckets against Redis's own clock (replicas'
clocks never meet) and charges them only if both admit the request, so a
refused request costs nothing. ``client`` is a hash of the API key, never
the key. A bucket holds ``burst_s`` seconds of the request rate and one
minute of the token rate. While Redis is unreachable each replica keeps
limiting with the same buckets in its own memory (each replica then allows
the whole rate: limits loosen by the replica count, they never switch off).

Admission is separate (:func:`over_slo`): with a TTFT bound set, a request
whose best predicted TTFT is over it gets 429 and ``Retry-After`` instead of
a place at the end of a queue it will not leave in time.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from engine_worker.protocol import ApiError
from indexer.ingest_reader import Client as RedisClient
from indexer.wire import Keyspace
from kvrouter.gateway.metrics import RouterMetrics

__all__ = ["Limit", "RateLimiter", "client_id", "over_slo"]

log = logging.getLogger(__name__)

# KEYS: one bucket per limit; ARGV: rate, depth (units), cost per bucket.
# Returns "0" (admitted, charged) or the seconds to wait, as a string (Lua numbers
# would be truncated to integers on the way out).
_GCRA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local wait = 0
local tats = {}
for i = 1, #KEYS do
  local rate = tonumber(ARGV[3 * i - 2])
  local depth = tonumber(ARGV[3 * i - 1])
  local cost = tonumber(ARGV[3 * i])
  local tat = tonumber(redis.call('GET', KEYS[i]) or '0')
  if tat < now then tat = now end
  local new = tat + cost / rate
  local over = new - now - depth / rate
  if over > wait then wait = over end
  tats[i] = new
end
if wait > 0 then return tostring(wait) end
for i = 1, #KEYS do
  redis.call('SET', KEYS[i], tostring(tats[i]), 'PX', math.ceil((tats[i] - now) * 1000) + 1000)
end
return '0'
"""

_LOCAL_CLIENTS = 10_000


def client_id(api_key: str | None) -> str:
    """A stable, non-reversible name for a client's buckets."""
    if not api_key:
        return "anonymous"
    return hashlib.sha256(api_key.encode()).hexdigest()[:24]


@dataclass(frozen=True, slots=True)
class Limit:
    """One bucket: ``rate`` units per second, up to ``depth`` units at once."""

    name: str
    rate: float
    depth: float


@dataclass(slots=True)
class RateLimiter:
    """Request and token buckets per client (Redis, or this replica's memory)."""

    metrics: RouterMetrics
    client: RedisClient | None = None
    keyspace: Keyspace = field(default_factory=Keyspace)
    requests_per_s: float = 0.0
    tokens_per_min: float = 0.0
    burst_s: float = 1.0
    clock: object = time.monotonic
    _local: OrderedDict[str, float] = field(default_factory=OrderedDict)
    _script: object = None

    @property
    def limits(self) -> list[Limit]:
        """The configured buckets."""
        out = []
        if self.requests_per_s > 0:
            out.append(
                Limit("requests", self.requests_per_s, max(self.requests_per_s * self.burst_s, 1.0))
            )
        if self.tokens_per_min > 0:
            out.append(Limit("tokens", self.tokens_per_min / 60.0, self.tokens_per_min))
        return out

    async def check(self, client: str, tokens: int) -> None:
        """Charge one request of ``tokens`` tokens to ``client``; raise 429 when over a limit."""
        limits = self.limits
        if not limits:
            return
        costs = [1.0 if lim.name == "requests" else float(tokens) for lim in limits]
        for lim, cost in zip(limits, costs, strict=True):
            if cost > lim.depth:
                self.metrics.rate_limited.labels(lim.name).inc()
                raise ApiError(
                    429,
                    f"Request too large: it needs {cost:.0f} {lim.name} and the limit allows "
                    f"{lim.depth:.0f} at once.",
                    type_="rate_limit_exceeded",
                    code=f"{lim.name}_exceed_limit",
                )
        wait = await self._charge(client, limits, costs)
        if wait > 0:
            names = "/".join(lim.name for lim in limits)
            self.metrics.rate_limited.labels(names).inc()
            raise ApiError(
                429,
                f"Rate limit reached for {names}; try again in {wait:.2f} s.",
                type_="rate_limit_exceeded",
                code="rate_limit_exceeded",
                headers={"retry-after": str(max(1, math.ceil(wait)))},
            )

    async def _charge(self, client: str, limits: list[Limit], costs: list[float]) -> float:
        if self.client is not None:
            # One hash tag: both buckets live in one Redis Cluster slot, as one script needs.
            keys = [self.keyspace.limit(f"{{{client}}}:{lim.name[:3]}") for lim in limits]
            args: list[float] = []
            for lim, cost in zip(limits, costs, strict=True):
                args += [lim.rate, lim.depth, cost]
            try:
                if self._script is None:
                    self._script = self.client.register_script(_GCRA)
                raw = await self._script(keys=keys, args=args)  # type: ignore[operator]
                return float(raw)
            except (RedisError, OSError) as exc:
                self.metrics.redis_errors.labels("rate_limit").inc()
                log.warning("rate limits: Redis unreachable (%s); limiting in this replica", exc)
        return self._charge_local(client, limits, costs)

    def _charge_local(self, client: str, limits: list[Limit], costs: list[float]) -> float:
        now = self.clock()  # type: ignore[operator]
        names = [f"{client}:{lim.name}" for lim in limits]
        tats = []
        wait = 0.0
        for name, lim, cost in zip(names, limits, costs, strict=True):
            tat = max(self._local.get(name, now), now) + cost / lim.rate
            wait = max(wait, tat - now - lim.depth / lim.rate)
            tats.append(tat)
        if wait > 0:
            return wait
        for name, tat in zip(names, tats, strict=True):
            self._local[name] = tat
            self._local.move_to_end(name)
        while len(self._local) > _LOCAL_CLIENTS:
            self._local.popitem(last=False)
        return 0.0


def over_slo(predicted_ttft_s: float | None, bound_s: float | None) -> ApiError | None:
    """The 429 for a request whose best predicted TTFT is over ``bound_s`` (None: admit)."""
    if bound_s is None or not predicted_ttft_s or predicted_ttft_s <= bound_s:
        return None
    wait = max(1, math.ceil(predicted_ttft_s - bound_s))
    return ApiError(
        429,
        f"The cluster is over capacity: the predicted time to first token is "
        f"{predicted_ttft_s:.2f} s, over this gateway's bound of {bound_s:.2f} s.",
        type_="rate_limit_exceeded",
        code="over_capacity",
        headers={"retry-after": str(wait)},
    )
