"""``kvrouter up``'s supervisor starts a child that exits again, after a back-off."""

from __future__ import annotations

import sys
from pathlib import Path

from kvrouter.supervisor import Child, Supervisor


def exited(child: Child) -> None:
    assert child.proc is not None
    child.proc.wait(30)


def test_a_child_that_keeps_exiting_starts_again_after_a_doubling_back_off(
    tmp_path: Path,
) -> None:
    sup = Supervisor(tmp_path, backoff_min_s=1.0, backoff_max_s=4.0, stable_s=60.0)
    crashing = sup.spawn("crashing", [sys.executable, "-c", "import sys; sys.exit(3)"])
    steady = sup.spawn("steady", [sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        t = crashing.started_at
        waits = []
        for _ in range(4):
            exited(crashing)
            assert crashing.proc is not None
            assert crashing.proc.returncode == 3
            first_pid = crashing.proc.pid
            assert sup.revive(t) == []  # its exit is seen; it waits out the back-off
            waits.append(crashing.backoff_s)
            assert sup.revive(t + crashing.backoff_s - 0.01) == []
            t += crashing.backoff_s
            assert sup.revive(t) == [crashing]
            assert crashing.proc.pid != first_pid
        # 1 s, doubling while it exits within a minute of each start, at most 4 s.
        assert waits == [1.0, 2.0, 4.0, 4.0]
        assert crashing.restarts == 4
        # A child that ran for a minute before it exited starts again after 1 s.
        exited(crashing)
        assert sup.revive(t + 60.0) == []
        assert crashing.backoff_s == 1.0
        # The live child was never touched.
        assert steady.restarts == 0
        assert steady.alive
    finally:
        sup.stop_all(grace_s=5.0)
    assert steady in sup.dead()
    assert (tmp_path / "crashing.log").exists()
