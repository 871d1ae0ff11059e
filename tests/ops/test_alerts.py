"""The alert rules pass ``promtool check rules`` and the unit tests of ``alerts_test.yaml``."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kvrouter.ops.alerts import ALERTS, PLACEHOLDER_DEFAULTS, render

HERE = Path(__file__).parent


@pytest.fixture
def rules_dir(tmp_path: Path) -> Path:
    """The rule file with the chart's default values, beside a copy of the unit tests."""
    text = render()
    for placeholder, default in PLACEHOLDER_DEFAULTS.items():
        assert placeholder in text
        text = text.replace(placeholder, default)
    (tmp_path / "kvrouter-alerts.yaml").write_text(text)
    shutil.copy(HERE / "alerts_test.yaml", tmp_path / "alerts_test.yaml")
    return tmp_path


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run promtool; missing, it is a failure (``make setup`` installs it), never a skip."""
    exe = shutil.which("promtool")
    assert exe, (
        "promtool is not on PATH: `apt-get install -y --no-install-recommends prometheus` "
        "(make setup does it with a fresh .venv)"
    )
    return subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_promtool_accepts_the_rules(rules_dir: Path) -> None:
    out = promtool("check", "rules", "kvrouter-alerts.yaml", cwd=rules_dir)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in out.stdout


def test_every_alert_fires_and_stays_quiet_as_its_unit_tests_say(rules_dir: Path) -> None:
    out = promtool("test", "rules", "alerts_test.yaml", cwd=rules_dir)
    assert out.returncode == 0, out.stdout + out.stderr
    tests = (HERE / "alerts_test.yaml").read_text()
    for alert in ALERTS:
        # At least one case that fires (exp_alerts with labels) and one that does not.
        blocks = tests.split(f"alertname: {alert.name}\n")[1:]
        assert any(b.lstrip().startswith("exp_alerts:\n") for b in blocks), alert.name
        assert any(b.lstrip().startswith("exp_alerts: []") for b in blocks), alert.name
