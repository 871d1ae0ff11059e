"""Write the Grafana dashboards and the alert rules into the Helm chart.

    python -m kvrouter.ops.generate [--out helm/kvrouter] [--check]

``--check`` writes nothing and exits 1 when a committed file differs from
what the code produces (``make dashboards`` regenerates them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvrouter.ops.alerts import render
from kvrouter.ops.dashboards import DASHBOARDS

__all__ = ["DEFAULT_OUT", "RULES_FILE", "files", "main"]

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "helm" / "kvrouter"
RULES_FILE = Path("rules") / "kvrouter-alerts.yaml"


def files() -> dict[Path, str]:
    """Relative path (under the chart) -> content of every generated file."""
    out = {
        Path("dashboards") / f"{stem}.json": json.dumps(build().to_json(), indent=2) + "\n"
        for stem, build in DASHBOARDS.items()
    }
    out[RULES_FILE] = render()
    return out


def main(argv: list[str] | None = None) -> int:
    """Write (or ``--check``) the generated files; the exit status of the command."""
    parser = argparse.ArgumentParser(prog="python -m kvrouter.ops.generate", description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the chart's directory")
    parser.add_argument("--check", action="store_true", help="only compare, write nothing")
    args = parser.parse_args(argv)
    stale = []
    for rel, content in files().items():
        path = args.out / rel
        current = path.read_text() if path.exists() else None
        if current == content:
            continue
        stale.append(path)
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
            print(f"wrote {path}")
    if args.check and stale:
        print("out of date (run `make dashboards`): " + ", ".join(map(str, stale)))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
