"""Every routing policy by name, so that the gateway, the CLI and the benchmarks
build them the same way: ``make_policy("sglang_cache_aware", seed=7, cache_threshold=0.3)``.

``kv_ttft`` is the default. Policies that draw random numbers take ``seed``;
the others ignore it, so a benchmark can pass one seed to every policy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from policies.base import Policy
from policies.dynamo_cost import DynamoCostPolicy
from policies.kv_ttft import KvTtftPolicy
from policies.least_load import LeastLoadPolicy
from policies.llmd_precise import LlmdPrecisePolicy
from policies.mooncake_conductor import MooncakeConductorPolicy
from policies.power_of_two import PowerOfTwoPolicy
from policies.random_choice import RandomPolicy
from policies.round_robin import RoundRobinPolicy
from policies.sglang_cache_aware import SglangCacheAwarePolicy

__all__ = ["DEFAULT_POLICY", "POLICIES", "PolicyFactory", "make_policy", "policy_names"]

DEFAULT_POLICY = "kv_ttft"

PolicyFactory = Callable[..., Policy]
"""Called as ``factory(seed, **options)``."""


def _unseeded(cls: Callable[..., Policy]) -> PolicyFactory:
    def build(seed: int, **options: Any) -> Policy:
        return cls(**options)

    return build


def _seeded(cls: Callable[..., Policy]) -> PolicyFactory:
    def build(seed: int, **options: Any) -> Policy:
        return cls(seed=seed, **options)

    return build


POLICIES: dict[str, PolicyFactory] = {
    "kv_ttft": _unseeded(KvTtftPolicy),
    "round_robin": _unseeded(RoundRobinPolicy),
    "random": _seeded(RandomPolicy),
    "least_load": _unseeded(LeastLoadPolicy),
    "power_of_two": _seeded(PowerOfTwoPolicy),
    "sglang_cache_aware": _unseeded(SglangCacheAwarePolicy),
    "llmd_precise": _seeded(LlmdPrecisePolicy),
    "dynamo_cost": _seeded(DynamoCostPolicy),
    "mooncake_conductor": _unseeded(MooncakeConductorPolicy),
}


def policy_names() -> list[str]:
    """Registered policy names, the default first, then alphabetical."""
    return [DEFAULT_POLICY, *sorted(n for n in POLICIES if n != DEFAULT_POLICY)]


def check_policy_names(names: Iterable[str], also: Sequence[str] = ()) -> None:
    """Refuse names that are not registered policies (nor one of ``also``, e.g. ``all``).

    Raises:
        ValueError: Every unknown name, and the valid ones, in one message.
    """
    known = set(POLICIES) | set(also)
    if bad := [n for n in names if n not in known]:
        valid = ", ".join([*also, *policy_names()])
        raise ValueError(f"unknown policy {', '.join(map(repr, bad))}; valid: {valid}")


def make_policy(name: str, *, seed: int = 0, **options: Any) -> Policy:
    """Build the policy registered as ``name`` with its documented defaults overridden by
    ``options``.

    Raises:
        ValueError: Unknown name (the message lists the valid ones), an option the
            policy does not take, or an option value out of range.
    """
    check_policy_names([name])
    factory = POLICIES[name]
    try:
        return factory(seed, **options)
    except TypeError as exc:
        raise ValueError(f"policy {name!r}: bad options {sorted(options)}: {exc}") from exc
