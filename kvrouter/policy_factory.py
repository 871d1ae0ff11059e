"""Policies as a router with exact load accounting runs them (the gateway and the simulator).

Both the gateway and the offline simulator know every request they routed
the moment they route it (the gateway counts them per worker; the
simulator's views are the schedulers' own state), so ``kv_ttft``'s
speculative *load* would count those requests twice; its speculative
*prefix* entries stay on. Policies that predict time fall back to the
default Llama-3-8B/H100 profile for workers that publish none.
"""

from __future__ import annotations

from typing import Any

from engine_worker.profiles import default_profile
from policies.base import Policy
from policies.registry import make_policy

__all__ = ["build_policy"]


def build_policy(name: str, seed: int = 0, **overrides: Any) -> Policy:
    """The registered policy ``name`` configured for an exactly-accounting router."""
    options: dict[str, Any] = {}
    if name in ("kv_ttft", "mooncake_conductor"):
        options["default_profile"] = default_profile()
    if name == "kv_ttft":
        options["speculative_load"] = False
    options.update(overrides)
    return make_policy(name, seed=seed, **options)
