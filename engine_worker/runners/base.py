"""What every runner offers the engine loop."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from engine_worker.scheduler import SchedulerPlan
from indexer.profile import TimingProfile

__all__ = ["Runner", "StepResult"]


@dataclass(slots=True)
class StepResult:
    """A step's outcome.

    Attributes:
        sampled: Sampled token per request id, for every scheduled sequence with ``want_logits``.
        duration_s: Measured wall time (torch) or modeled time (sim) of the step.
        modeled: True when ``duration_s`` is a model's prediction, not a measurement; the
            engine then waits it out to behave like real hardware.
    """

    sampled: dict[str, int] = field(default_factory=dict)
    duration_s: float = 0.0
    modeled: bool = False


class Runner(Protocol):
    """Executes scheduler plans."""

    name: str

    def execute(self, plan: SchedulerPlan) -> StepResult:
        """Compute (or model) one step."""
        ...

    def profile(self) -> TimingProfile:
        """The runner's current timing model (fitted from measurements for ``torch``)."""
        ...

    def forget(self, request_id: str) -> None:
        """Drop what the runner keeps for a request that ended (its sampler state)."""
        ...
