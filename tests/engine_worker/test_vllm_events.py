"""Our workers speak vLLM's KV-event protocol: real sockets, real workers, real vllm-router.

A sim worker with ``vllm_events_endpoint`` set publishes vLLM-format
batches; :mod:`indexer.vllm_adapter` (our subscriber of real vLLM engines)
must turn them back into exactly the keys the worker's pool holds, also
after replaying a range it missed. Then ``vllm-router --policy kv_aware``
(the PyPI binary) consumes two worker processes' events and must send
requests sharing a long prefix to the worker that holds it.
"""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio

from engine_worker.server import create_app
from engine_worker.vllm_events import VllmEventEncoder
from engine_worker.worker import Worker
from indexer.events import AllCleared, BlockRemoved, BlockStored
from indexer.index import MemoryIndex
from indexer.keys import block_keys, root_parent
from indexer.media import MEDIA, Medium
from indexer.vllm_adapter import VllmAdapter, VllmTranslator
from kvrouter.embedded_redis import free_port
from tests.indexer.ingest_support import eventually
from tests.support.cluster import worker_settings
from tests.support.servers import ServerProcess, serve_app

HBM, DRAM = Medium.HBM, Medium.DRAM
B = 16
ROOT = root_parent("tiny", "", "")
VLLM_ROUTER = Path(sys.executable).with_name("vllm-router")


def toks(start: int, n: int = 2) -> list[int]:
    return list(range(start, start + n * B))


# -- the encoder (pure) ---------------------------------------------------------------------


def test_stores_become_vllm_maps_that_the_adapter_keys_as_we_do() -> None:
    enc = VllmEventEncoder(B, ROOT)
    t = toks(100, 3)
    k = block_keys(t, B, ROOT)
    parents = [ROOT, k[0], k[1]]
    out = enc.encode(
        [BlockStored([k[i]], parents[i], HBM, t[i * B : (i + 1) * B]) for i in range(3)]
    )
    assert out == [{
        "type": "BlockStored", "block_hashes": k, "parent_block_hash": None, "token_ids": t,
        "block_size": B, "lora_id": None, "medium": "GPU", "lora_name": None,
    }]  # fmt: skip
    # Demoted to DRAM: stored on CPU with the tokens and parent of the first announcement.
    out = enc.encode([BlockRemoved([k[2]], HBM), BlockStored([k[2]], k[1], DRAM)])
    assert out == [
        {"type": "BlockRemoved", "block_hashes": [k[2]], "medium": "GPU"},
        {"type": "BlockStored", "block_hashes": [k[2]], "parent_block_hash": k[1],
         "token_ids": t[2 * B :], "block_size": B, "lora_id": None, "medium": "CPU",
         "lora_name": None},
    ]  # fmt: skip
    # Our adapter re-derives our keys from the tokens, whatever the hashes say.
    fresh = VllmEventEncoder(B, ROOT).encode([BlockStored([9, 10], ROOT, HBM, t[: 2 * B])])
    payload = msgspec.msgpack.encode([0.0, fresh, 0])
    assert VllmTranslator("tiny", B).translate(payload) == [BlockStored(k[:2], ROOT, HBM)]


def test_salted_chains_untokenized_blocks_and_snapshots() -> None:
    enc = VllmEventEncoder(B, ROOT)
    salted_root = root_parent("tiny", "", "s1")
    t = toks(300, 1)
    s = block_keys(t, B, salted_root)
    out = enc.encode([BlockStored(s, salted_root, HBM, t)])
    assert out[0]["parent_block_hash"] is None
    assert out[0]["extra_keys"] == [[f"root:{salted_root:016x}"]]
    tr = VllmTranslator("tiny", B)
    assert tr.translate(msgspec.msgpack.encode([0.0, out])) == []  # tracked, never indexed
    # A block whose tokens were never seen (SSD restore, peer import) is not announced.
    assert enc.encode([BlockStored([77], None, Medium.SSD)]) == []
    assert enc.encode([BlockRemoved([77], Medium.SSD)]) == []
    assert enc.stats.untokenized == 1
    # A snapshot without the salted block announces its removal.
    assert enc.reconcile({m: [] for m in MEDIA}) == [
        {"type": "BlockRemoved", "block_hashes": s, "medium": "GPU"}
    ]
    assert enc.encode([AllCleared()]) == [{"type": "AllBlocksCleared"}]


# -- a real worker and our adapter ------------------------------------------------------------


@contextmanager
def vllm_worker(name: str, **kw: Any) -> Iterator[tuple[str, Worker, str, str]]:
    """A sim worker in-process with vLLM events on; yields (url, worker, pub, replay)."""
    port = free_port()
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    settings = worker_settings(name, port, None, runner="sim", vllm_events_endpoint=pub,
                               vllm_events_replay_endpoint=replay, **kw)  # fmt: skip
    app = create_app(settings)
    with serve_app(app, port=port) as url:
        yield url, app.state.worker, pub, replay


async def pool_keys(client: httpx.AsyncClient, url: str) -> dict[Medium, list[int]]:
    blocks = (await client.get(f"{url}/kv/keys")).json()["blocks"]
    return {m: sorted(blocks.get(m.value, [])) for m in MEDIA}


def adapter_keys(adapter: VllmAdapter) -> dict[Medium, list[int]]:
    return {m: sorted(keys) for m, keys in adapter.translator.snapshot_blocks().items()}


async def workload(client: httpx.AsyncClient, url: str, rounds: int) -> None:
    """Shared prefixes and enough distinct prompts to demote blocks to DRAM and evict them."""
    shared = "You are a careful assistant. " * 8
    for i in range(rounds):
        prompt = shared + f"Question {i}?" if i % 2 else f"Unrelated prompt {i} " * (24 + i % 4)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4}
        r = await client.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 200, r.text


async def test_the_adapter_indexes_exactly_the_workers_blocks_and_replays_what_it_missed() -> None:
    small = {"hbm_blocks": 24, "dram_blocks": 16, "max_model_len": 256}
    with vllm_worker("w-vllm", **small) as (url, worker, pub, replay):
        index = MemoryIndex()
        adapter = VllmAdapter(index, "w-vllm", VllmTranslator("tiny", B), endpoint=pub,
                              replay_endpoint=replay)  # fmt: skip
        late = VllmAdapter(MemoryIndex(), "w-vllm", VllmTranslator("tiny", B), endpoint=pub,
                           replay_endpoint=replay)  # fmt: skip
        async with httpx.AsyncClient(timeout=60) as client:
            try:
                await adapter.start()
                await workload(client, url, 10)
                want = await pool_keys(client, url)
                assert want[DRAM], "the workload should demote blocks to DRAM"
                await eventually(lambda: adapter_keys(adapter) == want, what="adapter == pool")
                assert await index.entries("w-vllm") == {m: set(k) for m, k in want.items()}
                assert adapter.stats.decode_errors == 0
                assert worker.vllm_events is not None
                assert worker.vllm_events.encoder.stats.untokenized == 0
                # A subscriber that joins late sees seq > 0 first and replays 0.. from the
                # ROUTER socket: it ends with the same blocks, none lost.
                await late.start()
                await workload(client, url, 2)
                want = await pool_keys(client, url)
                await eventually(lambda: adapter_keys(late) == want, what="late adapter == pool")
                assert late.stats.replays == 1
                assert late.stats.lost == 0
                assert adapter_keys(adapter) == want
            finally:
                await adapter.stop()
                await late.stop()


async def test_the_replay_socket_answers_as_vllms_does() -> None:
    with vllm_worker("w-replay") as (url, worker, _pub, replay):
        async with httpx.AsyncClient(timeout=60) as client:
            await workload(client, url, 3)
        pub = worker.vllm_events
        assert pub is not None
        await eventually(lambda: pub.seq >= 3, what="three batches published")
        end = (-1).to_bytes(8, "big", signed=True)
        ctx = zmq.asyncio.Context()
        dealer = ctx.socket(zmq.DEALER)
        frames: list[list[bytes]] = []
        try:
            dealer.connect(replay)
            await dealer.send_multipart([b"", (1).to_bytes(8, "big")])
            while not frames or frames[-1][1] != end:
                frames.append(await dealer.recv_multipart())
        finally:
            dealer.close(linger=0)
            ctx.term()
        # [b"", seq, payload] for every kept batch from seq 1 on, then [b"", -1, b""].
        assert [len(f) for f in frames] == [3] * len(frames)
        seqs = [int.from_bytes(f[1], "big") for f in frames[:-1]]
        assert seqs == list(range(1, seqs[-1] + 1))
        assert seqs[-1] >= 2
        assert frames[-1] == [b"", end, b""]
        ts, events, rank = msgspec.msgpack.decode(frames[0][2])
        assert isinstance(ts, float)
        assert rank == 0
        assert events


# -- vllm-router --policy kv_aware against two worker processes ------------------------------


def sim_worker_proc(tmp_path: Path, name: str) -> tuple[ServerProcess, str, str, str]:
    port, pub, rep = free_port(), free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    proc = ServerProcess(
        ["worker", "--model", "tiny", "--runner", "sim", "--name", name, "--port", str(port),
         "--vllm-events", f"tcp://127.0.0.1:{pub}",
         "--vllm-events-replay", f"tcp://127.0.0.1:{rep}"],
        health_url=f"{url}/health", log_path=tmp_path / f"{name}.log",
    )  # fmt: skip
    return proc, url, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}"


@contextmanager
def vllm_router(tmp_path: Path, policy: str, workers: list[tuple[str, str, str]]) -> Iterator[str]:
    """``vllm-router`` on a free port; yields its URL (its log is ``tmp_path/router-*.log``)."""
    port = free_port()
    args = ["--host", "127.0.0.1", "--port", str(port),
            "--prometheus-port", str(free_port()), "--policy", policy,
            "--worker-urls", *(w[0] for w in workers), "--log-level", "debug"]  # fmt: skip
    if policy == "kv_aware":
        for url, pub, rep in workers:
            args += ["--kv-event-source", f"{url}={pub}"]
            args += ["--kv-event-replay-source", f"{url}={rep}"]
        args += ["--kv-event-block-size", str(B), "--kv-event-model", "tiny"]
    base = f"http://127.0.0.1:{port}"
    router = ServerProcess(args, program=[str(VLLM_ROUTER)], health_url=f"{base}/health",
                           log_path=tmp_path / f"router-{policy}.log",
                           env={"NO_COLOR": "1"})  # fmt: skip
    router.start(60)
    try:
        yield base
    finally:
        router.stop()


def cached_tokens(router: str, prompts: list[str]) -> list[int]:
    """Send ``prompts`` one after another; each response's cached prompt tokens."""
    out = []
    for p in prompts:
        body = {"model": "tiny", "prompt": p, "max_tokens": 2}
        r = httpx.post(f"{router}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        out.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    return out


def prompts(tag: str, prefixes: int = 4, each: int = 3) -> list[str]:
    """``each`` requests in a row per long shared prefix (~40 blocks), distinct tails."""
    return [
        " ".join(f"{tag}{p}w{i}" for i in range(150)) + f" question {q}"
        for p in range(prefixes)
        for q in range(each)
    ]


@pytest.mark.skipif(shutil.which(str(VLLM_ROUTER)) is None, reason="vllm-router is not installed")
def test_vllm_router_kv_aware_routes_on_our_workers_events(tmp_path: Path) -> None:
    procs = [sim_worker_proc(tmp_path, n) for n in ("va", "vb")]
    try:
        for proc, *_ in procs:
            proc.start()
        workers = [(url, pub, rep) for _, url, pub, rep in procs]
        with vllm_router(tmp_path, "kv_aware", workers) as router:
            kv = cached_tokens(router, prompts("kv"))
        with vllm_router(tmp_path, "round_robin", workers) as router:
            rr = cached_tokens(router, prompts("rr"))
        # kv_aware: a prefix's first request misses, the next two go where it is cached.
        kv_hits = sum(c > 500 for c in kv)
        rr_hits = sum(c > 500 for c in rr)
        assert kv_hits == 8, (kv, (tmp_path / "router-kv_aware.log").read_text()[-3000:])
        assert rr_hits < kv_hits, rr
        # The router's own account: prefixes credited from our events, nothing undecodable.
        log = re.sub(r"\x1b\[[0-9;]*m", "", (tmp_path / "router-kv_aware.log").read_text())
        assert re.search(r"KV prefix decision .*credited_prefix_tokens=[1-9]", log), log[-3000:]
        assert not re.search(r"WARN.*kv_index", log), log[-3000:]
    finally:
        for proc, *_ in procs:
            proc.stop()
