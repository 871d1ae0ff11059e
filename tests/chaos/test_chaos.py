"""Faults under steady load against a real fleet: what clients saw, how fast the system healed.

Each scenario runs the open-loop load of :mod:`tests.chaos.load` through
both gateway replicas, strikes once after a warm-up, keeps the load on, then
measures:

* the requests by outcome: ``failed_before_stream`` (goal 0: the gateway
  retries anything that has not streamed yet), ``gateway_gone`` (sent to a
  replica that was killed; reported, not a goal), streams cut (``cut_clean``
  ends with an error event and ``[DONE]``; ``cut_unclean`` must be 0);
* ``index_recovery_s``: from the end of the fault (the killed piece back,
  Redis back, the proxy healed, the load stopped for event drops) until the
  index audit passes (every live worker's blocks exactly in the index, no
  dead host left in it);
* ``counters_zero_s``: from the end of the load until every load counter
  reads zero (workers' running/waiting/in-flight and PD leases, the
  gateways' in-flight gauges, the replicas' load leases in Redis).

Each prints one line and, with ``KVROUTER_CHAOS_OUT``, writes its figures
to ``{name}.json``. Scenarios share one fleet (restarting what the previous
one killed); the one with event drops runs last since it restarts workers.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.chaos.conftest import ChaosSettings
from tests.chaos.fleet import Fleet, IndexState, Service, metric_samples, wait_for
from tests.chaos.load import LoadGenerator, LoadReport, LoadShape, Outcome

pytestmark = pytest.mark.chaos

#: Longest wait for the index to be exact again, and for counters to reach zero.
INDEX_CAP_S = 60.0
COUNTERS_CAP_S = 10.0


@dataclass(slots=True)
class Fault:
    """What a fault did (filled in by the fault function).

    Attributes:
        notes: Figures of the fault itself (what was killed, how long it was down).
        until_load_end: The fault lasts as long as the load (event drops): the
            index is measured from the end of the load.
    """

    notes: dict[str, Any] = field(default_factory=dict)
    until_load_end: bool = False


FaultFn = Callable[[Fleet, LoadGenerator, ChaosSettings], Fault]


def run_scenario(
    fleet: Fleet,
    chaos: ChaosSettings,
    name: str,
    fault_fn: FaultFn,
    *,
    shape: LoadShape | None = None,
    worker_env: dict[str, str] | None = None,
    may_cut: bool = False,
) -> dict[str, Any]:
    """Run one scenario, write and print its figures, assert its goals.

    Args:
        may_cut: Whether the fault may cut streams (a worker dies or its
            connections are cut); otherwise streams cut must be 0 too.
    """
    fleet.ensure(worker_env)
    shape = shape or LoadShape(rate=chaos.rate)
    scrape = [*fleet.gateway_urls, *(w.url for w in fleet.workers), fleet.indexer.url]
    retries_before = fleet.gateway_counters()
    load = LoadGenerator(fleet.gateway_urls, shape, scrape=scrape).start()
    t_start = time.monotonic()
    try:
        time.sleep(chaos.warmup_s)
        fault = fault_fn(fleet, load, chaos)
        fault_end = time.monotonic()
        load_end_at = max(t_start + chaos.load_s, fault_end + chaos.after_s)
        report, index_s, index_state = _measure(
            fleet, load, fault_end, load_end_at, until_load_end=fault.until_load_end
        )
    finally:
        if load.running:
            load.stop()
    zero_s, counters = fleet.wait_counters_zero(COUNTERS_CAP_S)
    final = fleet.index_state()
    fault.notes["gateway_counters"] = _delta(retries_before, fleet.gateway_counters())
    figures = _figures(name, chaos, shape, report, fault, index_s, index_state.detail, zero_s,
                       counters.nonzero(), final.ok, final.detail)  # fmt: skip
    chaos.write(name, figures)
    print(_summary(figures))
    failures = _goals(figures, may_cut=may_cut)
    assert not failures, f"{name}: " + "; ".join(failures) + f"\nfigures: {figures}"
    return figures


def _measure(
    fleet: Fleet, load: LoadGenerator, fault_end: float, load_end_at: float, *,
    until_load_end: bool,
) -> tuple[LoadReport, float | None, IndexState]:  # fmt: skip
    """Keep the load on until ``load_end_at`` while polling the index audit.

    Returns:
        The load report; seconds from the end of the fault (of the load, with
        ``until_load_end``) to an exact index, None past the cap; the last index state.
    """
    report: LoadReport | None = None
    load_end = 0.0
    index_s: float | None = None
    state = IndexState(False, "not checked")
    gave_up = False
    while True:
        if report is None and time.monotonic() >= load_end_at:
            report = load.stop()
            load_end = time.monotonic()
        measuring = index_s is None and not gave_up and (report is not None or not until_load_end)
        if measuring:
            origin = load_end if until_load_end else fault_end
            state = fleet.index_state()
            if state.ok:
                index_s = time.monotonic() - origin
            elif time.monotonic() - origin > INDEX_CAP_S:
                gave_up = True
        if report is not None and (index_s is not None or gave_up):
            return report, index_s, state
        pause = 0.5 if measuring else load_end_at - time.monotonic()
        time.sleep(min(0.5, max(0.0, pause)))


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Counter increases; a counter that went down was reset by a restart: its value is all."""
    return {k: v - before.get(k, 0.0) if v >= before.get(k, 0.0) else v for k, v in after.items()}


def _figures(
    name: str, chaos: ChaosSettings, shape: LoadShape, report: LoadReport, fault: Fault,
    index_s: float | None, index_detail: str, zero_s: float | None, nonzero: list[str],
    final_ok: bool, final_detail: str,
) -> dict[str, Any]:  # fmt: skip
    return {
        "scenario": name,
        "mode": chaos.mode,
        "rate": shape.rate,
        **report.figures(),
        "fault": fault.notes,
        "index_recovery_s": None if index_s is None else round(index_s, 2),
        "index_detail": "" if index_s is not None else index_detail,
        "counters_zero_s": None if zero_s is None else round(zero_s, 2),
        "counters_nonzero": nonzero,
        "index_ok_at_end": final_ok,
        "index_detail_at_end": final_detail,
    }


def _summary(f: dict[str, Any]) -> str:
    return (
        f"[chaos] {f['scenario']}: {f['requests']} requests, ok {f['ok']}, "
        f"failed_before_stream {f['failed_before_stream']}, gateway_gone {f['gateway_gone']}, "
        f"streams cut {f['streams_cut']} (clean {f['cut_clean']}, unclean {f['cut_unclean']}), "
        f"incomplete {f['incomplete']}, index_recovery_s {f['index_recovery_s']}, "
        f"counters_zero_s {f['counters_zero_s']}"
    )


def _goals(f: dict[str, Any], *, may_cut: bool) -> list[str]:
    """Every goal the scenario missed."""
    out = []
    for key in (Outcome.FAILED_BEFORE_STREAM, Outcome.CUT_UNCLEAN, Outcome.INCOMPLETE):
        if f[key]:
            out.append(f"{f[key]} {key} (goal 0): {f['examples'].get(key)}")
    if not may_cut and f["streams_cut"]:
        out.append(f"{f['streams_cut']} streams cut by a fault that should cut none: "
                   f"{f['examples'].get(Outcome.CUT_CLEAN)}")  # fmt: skip
    if f["index_recovery_s"] is None:
        out.append(f"index not exact within {INDEX_CAP_S:.0f}s: {f['index_detail']}")
    elif not f["index_ok_at_end"]:
        out.append(f"index wrong at the end: {f['index_detail_at_end']}")
    if f["counters_zero_s"] is None:
        out.append(f"load counters not zero {COUNTERS_CAP_S:.0f}s after the load: "
                   f"{f['counters_nonzero']}")  # fmt: skip
    return out


# -- fault helpers --------------------------------------------------------------------------------


def wait_view(
    fleet: Fleet, workers: list[Service], test: Callable[[dict[str, Any]], bool], cap_s: float
) -> tuple[Service, dict[str, Any], bool]:
    """Poll the workers' views until one passes ``test`` (or the cap).

    Returns:
        That worker (the first one at the cap), its last view, and whether it passed.
    """
    found: tuple[Service, dict[str, Any]] | None = None

    def probe() -> bool | None:
        nonlocal found
        for w in workers:
            seen = fleet.worker_view(w)
            if seen and test(seen):
                found = (w, seen)
                return True
        return None

    wait_for(probe, cap_s, 0.01)
    if found is not None:
        return found[0], found[1], True
    return workers[0], fleet.worker_view(workers[0]), False


def restart(fleet: Fleet, service: Service, fault: Fault) -> None:
    """Start a killed service again; note how long it took to be back and routable."""
    t0 = time.monotonic()
    service.start(service.extra_env)
    fault.notes["restart_s"] = round(time.monotonic() - t0, 2)
    if service in fleet.workers:
        for g in fleet.gateways:
            fleet.wait_routable(g, len(fleet.workers), 30.0)
    fault.notes["back_s"] = round(time.monotonic() - t0, 2)


def _kill_worker(fleet: Fleet, test: Callable[[dict[str, Any]], bool], fault: Fault) -> None:
    """SIGKILL the first worker whose view passes ``test``, then start it again."""
    victim, seen, met = wait_view(fleet, fleet.workers, test, 10.0)
    at_kill = {k: seen.get(k) for k in ("running", "waiting", "queued_prefill_tokens")}
    fault.notes.update(victim=victim.name, condition_met=met, view_at_kill=at_kill)
    victim.kill()
    restart(fleet, victim, fault)


# -- scenarios ------------------------------------------------------------------------------------


def test_worker_sigkill_midstream(fleet: Fleet, chaos: ChaosSettings) -> None:
    """A worker dies with streams running: they end with an error event; nothing else fails."""

    def fault(fl: Fleet, load: LoadGenerator, c: ChaosSettings) -> Fault:
        f = Fault()
        _kill_worker(fl, lambda v: v["running"] >= 2 and v["queued_prefill_tokens"] == 0, f)
        return f

    figures = run_scenario(fleet, chaos, "worker_sigkill_midstream", fault, may_cut=True)
    assert figures["fault"]["condition_met"], "the worker had no stream running when killed"


def test_worker_sigkill_midprefill(fleet: Fleet, chaos: ChaosSettings) -> None:
    """A worker dies while long prompts are being prefilled: the gateway retries them."""
    shape = LoadShape(rate=chaos.rate / 2, prefix_blocks=0, own_tokens=(2048, 4096), seed=2)

    def fault(fl: Fleet, load: LoadGenerator, c: ChaosSettings) -> Fault:
        f = Fault()
        _kill_worker(fl, lambda v: v["queued_prefill_tokens"] > 0, f)
        return f

    figures = run_scenario(fleet, chaos, "worker_sigkill_midprefill", fault, shape=shape,
                           may_cut=True)  # fmt: skip
    assert figures["fault"]["condition_met"], "the worker had no prefill queued when killed"


def test_worker_sigterm_drains(fleet: Fleet, chaos: ChaosSettings) -> None:
    """SIGTERM: the worker leaves the registry, refuses new work, finishes its streams, exits."""

    def fault(fl: Fleet, load: LoadGenerator, c: ChaosSettings) -> Fault:
        f = Fault()
        victim, seen, _ = wait_view(fl, fl.workers, lambda v: v["running"] >= 2, 10.0)
        f.notes.update(victim=victim.name, running_at_sigterm=seen.get("running"))
        exit_s = victim.terminate(timeout=30.0)
        f.notes["exit_s"] = None if exit_s is None else round(exit_s, 2)
        restart(fl, victim, f)
        return f

    figures = run_scenario(fleet, chaos, "worker_sigterm_drain", fault)
    assert figures["fault"]["exit_s"] is not None, "the worker did not exit within 30 s"


def test_gateway_replica_sigkill(fleet: Fleet, chaos: ChaosSettings) -> None:
    """A gateway replica dies: its own clients lose their requests, the other replica's none;
    its load lease expires instead of counting forever."""

    def fault(fl: Fleet, load: LoadGenerator, c: ChaosSettings) -> Fault:
        f = Fault()
        victim = fl.gateways[1]
        load.mark_down(victim.url)
        victim.kill()
        f.notes["victim"] = victim.name
        time.sleep(c.outage_s)
        restart(fl, victim, f)
        fl.wait_routable(victim, len(fl.workers), 30.0)
        load.mark_up(victim.url)
        return f

    run_scenario(fleet, chaos, "gateway_sigkill", fault)


def test_indexer_sigkill(fleet: Fleet, chaos: ChaosSettings) -> None:
    """The indexer dies and comes back: routing goes on; the index catches up from the streams."""

    def fault(fl: Fleet, load: LoadGenerator, c: ChaosSettings) -> Fault:
        f = Fault()
        fl.indexer.kill()
        time.sleep(c.outage_s)
        restart(fl, fl.indexer, f)
        return f

    run_scenario(fleet, chaos, "indexer_sigkill", fault)


def test_redis_restart_with_data(fleet: Fleet, chaos: ChaosSettings) -> None:
    """Redis stops (AOF flushed) and comes back with its data; nothing a client sees fails."""

    def fault(fl: Fleet, load: LoadGenerator, c: ChaosSettings) -> Fault:
        fl.redis.restart_with_data(c.outage_s)
        return Fault({"down_s": c.outage_s, "persistence": "appendonly, SIGTERM"})

    run_scenario(fleet, chaos, "redis_restart_with_data", fault)


def test_redis_restart_without_data(fleet: Fleet, chaos: ChaosSettings) -> None:
    """Redis dies and comes back empty: workers re-register and resend snapshots."""

    def fault(fl: Fleet, load: LoadGenerator, c: ChaosSettings) -> Fault:
        fl.redis.restart_without_data(c.outage_s)
        return Fault({"down_s": c.outage_s, "persistence": "none (SIGKILL, data wiped)"})

    run_scenario(fleet, chaos, "redis_restart_without_data", fault)


def test_redis_proxy_latency_and_cuts(fleet: Fleet, chaos: ChaosSettings) -> None:
    """50 ms on every Redis chunk, then every Redis connection of every process cut at once,
    then new connections refused for a moment."""

    def fault(fl: Fleet, load: LoadGenerator, c: ChaosSettings) -> Fault:
        p = fl.redis_proxy
        p.set_latency(50)
        time.sleep(max(2.0, c.outage_s * 2))
        cut = p.cut()
        p.set_refusing(True)
        time.sleep(c.outage_s / 2)
        p.set_refusing(False)
        cut += p.cut()
        p.heal()
        return Fault({"latency_ms": 50, "connections_cut": cut, "refused": p.stats.refused})

    run_scenario(fleet, chaos, "redis_proxy_faults", fault)


def test_worker_proxy_latency_and_cuts(fleet: Fleet, chaos: ChaosSettings) -> None:
    """50 ms on every chunk to and from one worker, then its connections cut mid-stream, then
    its new connections refused for a moment: cut streams end cleanly, the rest are retried."""

    def fault(fl: Fleet, load: LoadGenerator, c: ChaosSettings) -> Fault:
        p, victim = fl.worker_proxy, fl.workers[-1]
        p.set_latency(50)
        time.sleep(max(1.5, c.outage_s))
        _, seen, _ = wait_view(fl, [victim], lambda v: v["running"] >= 1, 10.0)
        cut = p.cut()
        p.set_refusing(True)
        time.sleep(c.outage_s)
        p.set_refusing(False)
        p.heal()
        notes = {"victim": victim.name, "latency_ms": 50, "running_at_cut": seen.get("running")}
        return Fault({**notes, "connections_cut": cut, "refused": p.stats.refused})

    run_scenario(fleet, chaos, "worker_proxy_faults", fault, may_cut=True)


def test_event_batches_dropped(fleet: Fleet, chaos: ChaosSettings) -> None:
    """Every worker drops 1% of its event batches: the indexer sees the gaps and resyncs."""
    env = {"KVWORKER_EVENT_DROP_RATE": "0.01"}

    def snapshots() -> dict[str, float]:
        text = httpx.get(fleet.indexer.url + "/metrics", timeout=5.0).text
        samples = metric_samples(text, "kvindex_ingest_snapshot_requests_total")
        return {labels.get("reason", "?"): v for labels, v in samples}

    def fault(fl: Fleet, load: LoadGenerator, c: ChaosSettings) -> Fault:
        return Fault({"drop_rate": 0.01}, until_load_end=True)

    fleet.ensure(env)
    before = snapshots()
    try:
        run_scenario(fleet, chaos, "event_batches_dropped", fault, worker_env=env)
    finally:
        after = snapshots()
        asked = {r: after[r] - before.get(r, 0.0) for r in after}
        print(f"[chaos] event_batches_dropped: snapshots asked by reason {asked}")
        path = chaos.out / "event_batches_dropped.json" if chaos.out else None
        if path is not None and path.exists():
            figures = json.loads(path.read_text())
            figures["fault"]["snapshots_asked"] = asked
            chaos.write("event_batches_dropped", figures)
