"""How fast requests are being routed to each worker, from the requests' own timestamps.

Pure state: fed with each routing decision's ``now`` and chosen host, it
keeps an exponentially decaying count per host, so a worker's rate follows
what the policy actually sends it (an idle worker's rate falls to zero) and
nothing reads a clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["RouteRates"]


@dataclass(slots=True)
class RouteRates:
    """Requests per second routed to each host, decayed with time constant ``tau_s``."""

    tau_s: float = 5.0
    _value: dict[str, float] = field(default_factory=dict)
    _last: dict[str, float] = field(default_factory=dict)

    def rate(self, host: str, now: float) -> float:
        """Recent routings to ``host`` per second (0.0 for a host never chosen)."""
        value = self._value.get(host)
        if value is None:
            return 0.0
        age = max(now - self._last[host], 0.0)
        return value * math.exp(-age / self.tau_s)

    def record(self, host: str, now: float, weight: float = 1.0) -> None:
        """Count one request (or ``weight`` of one) routed to ``host`` at ``now``."""
        self._value[host] = self.rate(host, now) + weight / self.tau_s
        self._last[host] = max(now, self._last.get(host, now))
