"""KV transfer throughput between two workers against a raw loopback socket copy.

Two real workers (``kvrouter worker``, torch runner, SmolLM2-135M's KV geometry:
30 layers x 3 KV heads x 64 dims, float32, 737 KB per 16-token block) on this
machine. Worker A prefills ``--rounds`` distinct prompts of ``--prompt-tokens``
tokens; for each, worker B pulls the prompt's blocks from A (``POST /kv/pull``:
A pins them between two engine steps and sends them from its KV tensor over its
data socket; B reserves fresh blocks, receives each block straight into one,
checks model, layout, keys and every xxh3 checksum, then caches them). Right after
each pull the same number of bytes is copied through a plain loopback TCP socket (a
sender thread writing one buffer of random bytes, the receiver reading into a
preallocated, already mapped buffer): the ceiling of any transfer over loopback on
this machine, measured side by side. The pull is timed end to end (B asks its pool
what it lacks, finds A's data port, the transfer, the import); the figure is the
ratio of the two throughputs per round (median over rounds).

With ``--busy-tokens N`` each round also pulls a second prompt while both workers
prefill an ``N``-token prompt of their own (sent just before the pull), and reports
that pull's time over the idle one's: what a pull to or from a busy worker costs
(the pool work of a pull used to wait for each worker's step in progress).

With ``--from-ssd`` worker A keeps a small HBM over an SSD tier, and each
prompt is pushed down to A's SSD before B pulls it, while A streams a decode of
its own: the table then gives A's decode step gaps during the pull against its
median gap, i.e. how long serving a peer's pull of SSD blocks holds up the
source's own steps (a source used to read those blocks inside its pool call,
under the scheduler lock). ``--cold`` also drops A's SSD file from the page
cache before each pull, so the source's reads go to the disk: a pull then
takes about the longer of the reads and the network if the source overlaps
them, their sum if it reads everything first.

    python -m kvrouter.tools.transfer_bench --rounds 5 --prompt-tokens 2048
    python -m kvrouter.tools.transfer_bench --rounds 5 --prompt-tokens 1024 --busy-tokens 6144
    python -m kvrouter.tools.transfer_bench --rounds 5 --prompt-tokens 2048 --from-ssd
    python -m kvrouter.tools.transfer_bench --rounds 5 --prompt-tokens 2048 --from-ssd --cold
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console

from engine_worker.ssd_tier import SLOTS_FILE
from indexer.keys import block_keys, root_parent
from kvrouter.embedded_redis import free_port
from kvrouter.tools.table import grid

__all__ = ["main", "raw_copy_seconds"]

VOCAB = 49_152
#: The socket buffers the workers' data path asks for, given to the raw copy as well.
SOCKET_BUFFER = 8 << 20


def raw_copy_seconds(num_bytes: int, chunk: int = 1 << 20) -> float:
    """Seconds to move ``num_bytes`` through a loopback TCP connection (send + receive).

    The bytes are random and written before the clock starts, as a worker's KV blocks
    are: a zero-filled buffer (``bytes(n)``, which this copy once sent) maps every page
    to the kernel's one zero page, so the sender read the same cached 4 KiB over and
    over and the "ceiling" was a ceiling for no real data.
    """
    payload = memoryview(random.Random(num_bytes).randbytes(num_bytes))
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def send() -> None:
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
            conn.sendall(payload)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    sink = bytearray(payload)  # written once: its pages are mapped, as a worker's KV tensor's are
    view = memoryview(sink)
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        start = time.perf_counter()
        got = 0
        while got < num_bytes:
            n = client.recv_into(view[got:], min(chunk, num_bytes - got))
            if n == 0:
                raise RuntimeError("raw copy: connection closed early")
            got += n
        seconds = time.perf_counter() - start
    thread.join()
    server.close()
    return seconds


def _start(
    name: str, port: int, log_dir: Path, blocks: int, prompt_tokens: int, ssd_blocks: int = 0
) -> subprocess.Popen[bytes]:
    length = max(min(8192, blocks * 16), prompt_tokens + 16)
    args = [
        sys.executable, "-m", "kvrouter", "worker", "--model", "smollm2", "--runner", "torch",
        "--port", str(port), "--name", name, "--hbm-blocks", str(blocks), "--dram-blocks", "0",
        "--max-model-len", str(length), "--max-num-batched-tokens", "2048",
    ]  # fmt: skip
    if ssd_blocks:
        args += ["--ssd-blocks", str(ssd_blocks), "--ssd-path", str(log_dir / f"{name}-ssd")]
    log = (log_dir / f"{name}.log").open("wb")
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait(url: str, proc: subprocess.Popen[bytes], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker at {url} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"worker at {url} did not start")


def _prefill(url: str, model: str, prompt: list[int]) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": 1}
    httpx.post(f"{url}/v1/completions", json=body, timeout=600).raise_for_status()


def _keys(model: str, prompt: list[int]) -> list[int]:
    """The block keys of ``prompt`` on the workers (16-token blocks)."""
    return block_keys(prompt, 16, root_parent(model))


def _pull(a: str, b: str, model: str, prompt: list[int]) -> dict[str, Any]:
    """Have ``b`` pull all the blocks of ``prompt`` (prefilled on ``a``) from ``a``."""
    keys = _keys(model, prompt)
    pull: dict[str, Any] = httpx.post(
        f"{b}/kv/pull", json={"source": a, "keys": keys}, timeout=600
    ).json()
    if pull["pulled"] != len(keys):
        raise RuntimeError(f"pulled {pull['pulled']} of {len(keys)} blocks")
    return pull


def _on_ssd(url: str, model: str, prompt: list[int]) -> int:
    """How many of ``prompt``'s blocks ``url`` holds on its SSD."""
    keys = set(_keys(model, prompt))
    held = httpx.get(f"{url}/kv/keys", timeout=10).json()["blocks"]
    return len(keys & set(held.get("ssd", [])))


def _drop_cached(path: Path) -> None:
    """Write ``path``'s dirty pages out and drop the file from the page cache, so that
    the next reads of it go to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _decode_times(url: str, model: str, prompt: list[int], tokens: int) -> list[float]:
    """Stream a greedy decode of ``tokens`` tokens; the arrival time of each."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    times = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    return times


def _pull_beside_decode(
    a: str, b: str, model: str, prompt: list[int], rng: random.Random
) -> tuple[dict[str, Any], float, float]:
    """Pull ``prompt`` from ``a`` to ``b`` while ``a`` streams a decode; returns the pull,
    ``a``'s longest step gap during it and its median gap over the whole decode."""
    times: list[float] = []
    question = [rng.randrange(VOCAB) for _ in range(32)]
    thread = threading.Thread(target=lambda: times.extend(_decode_times(a, model, question,
                                                                         160)))  # fmt: skip
    thread.start()
    time.sleep(1.5)  # the decode is under way
    t0 = time.perf_counter()
    pull = _pull(a, b, model, prompt)
    t1 = time.perf_counter()
    thread.join()
    gaps = [(end, end - start) for start, end in itertools.pairwise(times)]
    during = [g for end, g in gaps if t0 <= end and end - g <= t1]
    if not during:
        raise RuntimeError("the decode did not overlap the pull; lengthen it")
    return pull, max(during), statistics.median(g for _, g in gaps)


def _busy(urls: tuple[str, str], model: str, prompts: list[list[int]]) -> list[threading.Thread]:
    """Start one long prefill on each worker (threads; join them after)."""

    threads = [
        threading.Thread(target=_prefill, args=(url, model, prompt))
        for url, prompt in zip(urls, prompts, strict=True)
    ]
    for t in threads:
        t.start()
    time.sleep(0.5)  # both requests admitted: each worker is in its first prefill chunk
    return threads


def main(
    rounds: Annotated[int, typer.Option(min=1, help="Prompts pulled (one ratio each)")] = 5,
    prompt_tokens: Annotated[int, typer.Option(min=16, help="Tokens per prompt")] = 2048,
    busy_tokens: Annotated[
        int, typer.Option(min=0, help="Also pull while both workers prefill this many tokens")
    ] = 0,
    seed: Annotated[int, typer.Option(help="Prompt seed")] = 0,
    from_ssd: Annotated[
        bool, typer.Option(help="Pull each prompt off A's SSD while A decodes")
    ] = False,
    cold: Annotated[
        bool, typer.Option(help="With --from-ssd: drop A's SSD file from the page cache first")
    ] = False,
) -> None:
    """Measure and print the transfer / raw loopback throughput ratio."""
    console = Console()
    rng = random.Random(seed)
    per_round = (prompt_tokens // 16 + 2) * (2 if busy_tokens else 1) + 2 * (busy_tokens // 16 + 2)
    blocks = rounds * per_round + 64
    # From SSD: A's HBM holds two prompts and a decode, so a filler prompt of the same
    # size pushes the one before down to SSD, which holds every round's.
    hbm_a = 2 * (prompt_tokens // 16 + 2) + 16 if from_ssd else blocks
    ssd_a = 2 * rounds * (prompt_tokens // 16 + 2) if from_ssd else 0
    with tempfile.TemporaryDirectory() as tmp:
        ports = free_port(), free_port()
        length = max(prompt_tokens, busy_tokens)
        procs = [
            _start("a", ports[0], Path(tmp), hbm_a, length, ssd_a),
            _start("b", ports[1], Path(tmp), blocks, length),
        ]
        a, b = (f"http://127.0.0.1:{p}" for p in ports)
        try:
            for url, proc in zip((a, b), procs, strict=True):
                _wait(url, proc)
            model = httpx.get(f"{a}/v1/models", timeout=10).json()["data"][0]["id"]
            rows = []
            busy: list[tuple[float, float]] = []
            stalls: list[tuple[int, float, float, float]] = []
            for _ in range(rounds):
                prompt = [rng.randrange(VOCAB) for _ in range(prompt_tokens)]
                _prefill(a, model, prompt)
                if from_ssd:
                    for _ in range(2):
                        _prefill(a, model, [rng.randrange(VOCAB) for _ in range(prompt_tokens)])
                    on_ssd = _on_ssd(a, model, prompt)
                    if cold:
                        _drop_cached(Path(tmp) / "a-ssd" / SLOTS_FILE)
                    pull, stall, median_gap = _pull_beside_decode(a, b, model, prompt, rng)
                    stalls.append((on_ssd, pull["seconds"], stall, median_gap))
                else:
                    pull = _pull(a, b, model, prompt)
                raw = raw_copy_seconds(pull["bytes"])
                rows.append((pull["pulled"], pull["bytes"], pull["seconds"], raw))
                if busy_tokens:
                    prompt = [rng.randrange(VOCAB) for _ in range(prompt_tokens)]
                    _prefill(a, model, prompt)
                    long = [[rng.randrange(VOCAB) for _ in range(busy_tokens)] for _ in "ab"]
                    threads = _busy((a, b), model, long)
                    loaded = _pull(a, b, model, prompt)
                    for t in threads:
                        t.join()
                    busy.append((pull["seconds"], loaded["seconds"]))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(30)
    ratios = [raw_s / pull_s for _, _, pull_s, raw_s in rows]
    cells = [
        (str(i), str(n), f"{size / 1e6:,.1f}", f"{size / pull_s / 1e9:.2f}",
         f"{size / raw_s / 1e9:.2f}", f"{raw_s / pull_s:.2f}")
        for i, (n, size, pull_s, raw_s) in enumerate(rows)
    ]  # fmt: skip
    columns = ("round", "blocks", "MB", "pull GB/s", "raw GB/s", "pull / raw")
    title = "KV transfer between workers vs a raw loopback socket copy"
    console.print(grid(title, columns, cells, justify="right"))
    console.print(f"median pull / raw throughput: {statistics.median(ratios):.2f}")
    if busy:
        timed = [
            (str(i), f"{idle * 1e3:,.0f}", f"{loaded * 1e3:,.0f}", f"{loaded / idle:.2f}")
            for i, (idle, loaded) in enumerate(busy)
        ]
        title = f"The same pull, idle workers vs both prefilling {busy_tokens:,} tokens"
        console.print(grid(title, ("round", "idle ms", "busy ms", "busy / idle"), timed,
                           justify="right"))  # fmt: skip
        median = statistics.median(loaded / idle for idle, loaded in busy)
        console.print(f"median busy / idle pull time: {median:.2f}")
    if stalls:
        gap_rows = [
            (str(i), str(n), f"{pull_s * 1e3:,.0f}", f"{gap * 1e3:,.0f}",
             f"{typical * 1e3:,.0f}", f"{gap / typical:.2f}")
            for i, (n, pull_s, gap, typical) in enumerate(stalls)
        ]  # fmt: skip
        title = "A pull of A's SSD blocks while A decodes: A's step gaps"
        columns = ("round", "blocks on SSD", "pull ms", "A's longest gap during it ms",
                   "A's median gap ms", "longest / median")  # fmt: skip
        console.print(grid(title, columns, gap_rows, justify="right"))
        ratio = statistics.median(gap / typical for _, _, gap, typical in stalls)
        pull_ms = statistics.median(pull_s for _, pull_s, _, _ in stalls) * 1e3
        console.print(f"median longest / median gap during the pull: {ratio:.2f}; "
                      f"median pull {pull_ms:,.0f} ms")  # fmt: skip


if __name__ == "__main__":  # pragma: no cover
    typer.run(main)
