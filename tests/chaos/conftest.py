"""Chaos suite settings: how long each scenario runs, where figures go.

``KVROUTER_CHAOS=short`` (the default, part of ``make test``) gives every
fault scenario a few seconds of load so that the whole suite takes about
three minutes on two cores; ``KVROUTER_CHAOS=long`` (``make chaos``) gives
each 30-60 s. The soak runs ``KVROUTER_SOAK_S`` seconds (``make soak``
sets 600), 20 s by default. ``KVROUTER_CHAOS_OUT`` names a directory that
receives one JSON file of figures per scenario.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.fleet import Fleet, FleetSpec


@dataclass(frozen=True, slots=True)
class ChaosSettings:
    """Durations of one chaos run (see the module docstring).

    Attributes:
        mode: ``short`` or ``long``.
        load_s: Seconds of load per fault scenario (at least; faults that take
            longer, such as a worker restart, extend it).
        warmup_s: Load before the fault strikes.
        after_s: Load kept on after the fault ended.
        outage_s: How long a killed piece stays down before it is restarted.
        rate: Requests per second of the steady load.
        soak_s: Seconds of load of the soak run.
        out: Directory for the JSON figures, or None.
    """

    mode: str
    load_s: float
    warmup_s: float
    after_s: float
    outage_s: float
    rate: float
    soak_s: float
    out: Path | None

    @property
    def long(self) -> bool:
        """Whether this is the long run."""
        return self.mode == "long"

    def write(self, name: str, figures: dict[str, Any]) -> None:
        """Save ``figures`` as ``{out}/{name}.json`` (no-op without an output directory)."""
        if self.out is None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"{name}.json").write_text(json.dumps(figures, indent=2, sort_keys=True))


def chaos_settings() -> ChaosSettings:
    """The settings from ``KVROUTER_CHAOS``, ``KVROUTER_SOAK_S`` and ``KVROUTER_CHAOS_OUT``."""
    mode = os.environ.get("KVROUTER_CHAOS", "short").strip().lower() or "short"
    if mode not in ("short", "long"):
        raise pytest.UsageError(f"KVROUTER_CHAOS must be short or long, not {mode!r}")
    out = os.environ.get("KVROUTER_CHAOS_OUT")
    soak = os.environ.get("KVROUTER_SOAK_S")
    where = Path(out) if out else None
    if mode == "long":
        return ChaosSettings(mode, load_s=45.0, warmup_s=5.0, after_s=10.0, outage_s=5.0,
                             rate=15.0, soak_s=float(soak or 600), out=where)  # fmt: skip
    return ChaosSettings(mode, load_s=5.0, warmup_s=1.5, after_s=1.5, outage_s=1.0, rate=12.0,
                         soak_s=float(soak or 20), out=where)  # fmt: skip


@pytest.fixture(scope="session")
def chaos() -> ChaosSettings:
    """This run's durations and output directory."""
    return chaos_settings()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Redis (behind a proxy), an indexer, three sim workers (one behind a proxy), two gateways."""
    with Fleet(tmp_path_factory.mktemp("fleet"), FleetSpec()) as running:
        yield running
