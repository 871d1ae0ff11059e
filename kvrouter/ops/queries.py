"""PromQL snippets the dashboards repeat: rates, quantiles and means over Grafana's window."""

from __future__ import annotations

from kvrouter.ops.grafana import Target

__all__ = ["RATE", "mean", "quantile", "quantiles", "rate"]

RATE = "$__rate_interval"


def rate(metric: str, by: str = "", match: str = "") -> str:
    """``sum [by (labels)] (rate(metric{match}[$__rate_interval]))``."""
    grouping = f" by ({by})" if by else ""
    selector = f"{metric}{{{match}}}" if match else metric
    return f"sum{grouping} (rate({selector}[{RATE}]))"


def quantile(q: float, histogram: str, by: str = "") -> str:
    """``histogram_quantile`` of ``histogram`` over the rate window (``by`` kept apart)."""
    keep = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({keep}) (rate({histogram}_bucket[{RATE}])))"


def quantiles(histogram: str, qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> tuple[Target, ...]:
    """One target per quantile, legends ``p50``, ``p90``..."""
    return tuple(Target(quantile(q, histogram), f"p{round(q * 100)}") for q in qs)


def mean(histogram: str, by: str = "") -> str:
    """Mean observation over the rate window: rate of the sum over rate of the count."""
    return f"{rate(f'{histogram}_sum', by)} / {rate(f'{histogram}_count', by)}"
