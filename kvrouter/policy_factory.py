"""Policies as a router with exact load accounting runs them (the gateway and the simulator).

The one place where a policy's options are decided: the gateway, the
simulator and the benchmarks all build their policies here.

Both the gateway and the offline simulator know every request they routed
the moment they route it (the gateway counts them per worker; the
simulator's views are the schedulers' own state), so ``kv_ttft``'s
speculative *load* would count those requests twice; its speculative
*prefix* entries stay on. Policies that predict time fall back to the
default Llama-3-8B/H100 profile for workers that publish none. Router
settings that only some policies take (``speculative_ttl_s``, ``pooling``)
reach those policies and no other. ``kv_ttft`` prices pulling a peer's longer
prefix (pooling) unless told not to.
"""

from __future__ import annotations

from typing import Any

from engine_worker.profiles import default_profile
from policies.base import Policy
from policies.registry import make_policy

__all__ = ["build_policy"]


def build_policy(
    name: str,
    seed: int = 0,
    *,
    speculative_ttl_s: float | None = None,
    pooling: bool = True,
    **overrides: Any,
) -> Policy:
    """The registered policy ``name`` configured for an exactly-accounting router.

    Args:
        name: A registered policy.
        seed: Seeds randomized policies.
        speculative_ttl_s: How long ``kv_ttft`` trusts its speculative prefix entries
            (None: its default); ignored by other policies.
        pooling: Whether ``kv_ttft`` may pull a cached prefix from a peer. On by default:
            both routers that build policies here carry the pull out (the gateway asks the
            chosen worker to pull, the simulator moves the blocks), as Mooncake's conductor
            does with its hot-spot replication; ignored by other policies.
        overrides: More options for the policy itself.
    """
    options: dict[str, Any] = {}
    if name in ("kv_ttft", "mooncake_conductor"):
        options["default_profile"] = default_profile()
    if name == "kv_ttft":
        options["speculative_load"] = False
        if speculative_ttl_s is not None:
            options["speculative_ttl_s"] = speculative_ttl_s
        options["pooling"] = pooling
    options.update(overrides)
    return make_policy(name, seed=seed, **options)
