"""KV transfer between real workers (torch runner, tiny model) over loopback HTTP."""

from __future__ import annotations

import contextlib
import re
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import redis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from engine_worker.kv_transfer import TransferHeader, checksum
from engine_worker.profiles import default_profile
from engine_worker.server import create_app
from engine_worker.settings import WorkerSettings
from indexer.events import BlockStored, EventBatch, decode_message
from indexer.keys import block_keys, root_parent
from indexer.media import Medium
from indexer.profile import TimingProfile
from indexer.wire import EVENT_FIELD, Keyspace
from tests.support.redis_proc import free_port
from tests.support.servers import serve_app, tcp_listener

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPT = list(range(40, 120))  # 80 token ids: 5 full blocks of 16
KEYS = block_keys(PROMPT, 16, root_parent("tiny"))


def settings(name: str, **kw: Any) -> WorkerSettings:
    base: dict[str, Any] = {
        "model": "tiny", "name": name, "hbm_blocks": 48, "dram_blocks": 16,
        "max_model_len": 256, "max_num_batched_tokens": 128, "internal_token": TOKEN,
        "heartbeat_interval_s": 0.2, "heartbeat_ttl_s": 2.0,
    }  # fmt: skip
    base.update(kw)
    return WorkerSettings(**base)


@contextlib.contextmanager
def workers(*configs: WorkerSettings) -> Iterator[list[str]]:
    with contextlib.ExitStack() as stack:
        urls = []
        for config in configs:
            port = free_port()
            config = config.model_copy(update={"port": port})
            urls.append(stack.enter_context(serve_app(create_app(config), port=port)))
        yield urls


@pytest.fixture(scope="module")
def trio() -> Iterator[list[str]]:
    with workers(settings("a"), settings("b"), settings("c")) as urls:
        yield urls


def complete(
    url: str, prompt: list[int] = PROMPT, max_tokens: int = 6, token: str = TOKEN
) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    auth = {"authorization": f"Bearer {token}"}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=60)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def pull(url: str, source: str, keys: list[int] = KEYS, **kw: Any) -> httpx.Response:
    headers = kw.pop("headers", AUTH)
    body = {"source": source, "keys": keys}
    return httpx.post(f"{url}/kv/pull", json=body, headers=headers, timeout=60)


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    pattern = rf"^kvworker_{name}\{{?{re.escape(labels)}\}}? (\S+)$"
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def hbm_keys(url: str) -> set[int]:
    blocks = httpx.get(f"{url}/kv/keys", headers=AUTH, timeout=10).json()["blocks"]
    return set(blocks.get(Medium.HBM.value, []))


def test_a_pulled_prefix_is_used_and_the_output_is_the_same_token_for_token(
    trio: list[str],
) -> None:
    a, b, c = trio
    reference = complete(a)
    assert set(KEYS) <= hbm_keys(a)
    r = pull(b, a)
    assert r.status_code == 200, r.text
    result = r.json()
    assert (result["requested"], result["present"], result["pulled"]) == (5, 0, 5)
    assert set(KEYS) <= hbm_keys(b)
    # B decodes from A's blocks: the same greedy tokens as A and as C, which computed
    # everything itself, and it reports the prefix as cached.
    pooled = complete(b)
    fresh = complete(c)
    assert pooled["choices"][0]["text"] == reference["choices"][0]["text"]
    assert fresh["choices"][0]["text"] == reference["choices"][0]["text"]
    # Every block hit: the last one is still computed (its last token must be sampled).
    assert pooled["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert metric(a, "kv_transfer_blocks_total", 'direction="sent"') == 5
    assert metric(b, "kv_transfer_blocks_total", 'direction="received"') == 5
    view = httpx.get(f"{b}/worker/view", headers=AUTH, timeout=10).json()
    assert view["transfer_bandwidth"] > 0
    # Pulling again moves nothing: B holds the run.
    again = pull(b, a).json()
    assert (again["present"], again["pulled"]) == (5, 0)


def pull_whole(pool: ThreadPoolExecutor, dst: str, src: str, prompts: list[list[int]]) -> None:
    """Have ``dst`` pull each prompt's 5 blocks from ``src`` at once; every pull whole."""
    pulls = [pool.submit(pull, dst, src, block_keys(p, 16, root_parent("tiny"))) for p in prompts]
    for f in pulls:
        r = f.result()
        assert r.status_code == 200, r.text
        assert r.json()["pulled"] == 5


def decode_pulled(url: str, prompts: list[list[int]], refs: list[str]) -> None:
    """``url`` answers each pulled prompt as ``refs`` says, from its 4 cached blocks."""
    for p, ref in zip(prompts, refs, strict=True):
        pooled = complete(url, p)
        assert pooled["choices"][0]["text"] == ref
        assert pooled["usage"]["prompt_tokens_details"]["cached_tokens"] == 64


def test_pulls_beside_busy_steps_keep_every_output_exact() -> None:
    # A pull's pool work (reserve, pin, commit) runs while the runner executes a step:
    # pulls into a worker busy with other prompts, from a worker busy too, must neither
    # change any output nor leave a block in use.
    pulled = [list(range(300 + 90 * i, 380 + 90 * i)) for i in range(4)]  # 5 blocks each
    busy = [[(31 * j + 7 * k) % 900 + 1 for k in range(150)] for j in range(6)]
    big = {"hbm_blocks": 256}
    with workers(settings("a", **big), settings("b", **big), settings("c", **big)) as urls:
        a, b, c = urls
        refs = [complete(a, p)["choices"][0]["text"] for p in pulled]
        fresh = [complete(c, q, max_tokens=12)["choices"][0]["text"] for q in busy]
        with ThreadPoolExecutor(12) as pool:
            loads = [pool.submit(complete, u, q, 12) for q in busy for u in (a, b)]
            pull_whole(pool, b, a, pulled)
            texts = [f.result()["choices"][0]["text"] for f in loads]
        assert texts == [t for t in fresh for _ in (a, b)]
        decode_pulled(b, pulled, refs)
        assert in_use(a) == in_use(b) == 0


#: A prompt of 5 full blocks that a source with :func:`small_hbm` pushes down its tiers.
LOW = list(range(3000, 3080))
LOW_KEYS = block_keys(LOW, 16, root_parent("tiny"))


def small_hbm(tmp_path: Path) -> WorkerSettings:
    """A source whose 12 HBM blocks hold one prompt; DRAM 2 and SSD 64 below."""
    return settings(
        "src", hbm_blocks=12, dram_blocks=2, ssd_blocks=64, ssd_path=tmp_path, max_model_len=128
    )


def push_down(url: str) -> dict[int, str]:
    """18 more blocks on ``url`` (:func:`small_hbm`) push :data:`LOW`'s down the tiers, at
    least 3 to the SSD; where each block ``url`` holds sits (key -> medium)."""
    for i in range(3):
        complete(url, list(range(4000 + 100 * i, 4080 + 100 * i)))
    held = httpx.get(f"{url}/kv/keys", headers=AUTH, timeout=10).json()["blocks"]
    where = {k: m for m, ks in held.items() for k in ks}
    assert all(k in where for k in LOW_KEYS)
    assert [where[k] for k in LOW_KEYS].count(Medium.SSD.value) >= 3
    return where


def test_a_peers_dram_and_ssd_copies_are_pulled_exactly_and_let_go(tmp_path: Path) -> None:
    # The source pins the blocks on every tier in one pool call and reads the SSD ones on
    # its sending thread; whichever path the bytes take (data socket or HTTP), the
    # receiver gets the prefix exactly and the source holds no pin afterwards.
    prompt, keys = LOW, LOW_KEYS
    with workers(small_hbm(tmp_path), settings("dst")) as (src, dst):
        text = complete(src, prompt)["choices"][0]["text"]
        where = push_down(src)
        r = pull(dst, src, keys=keys)
        assert r.status_code == 200, r.text
        assert r.json()["pulled"] == 5
        pooled = complete(dst, prompt)
        assert pooled["choices"][0]["text"] == text
        assert pooled["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
        # The HTTP path reads the same way.
        body = httpx.post(f"{src}/kv/blocks", json={"keys": keys}, headers=AUTH, timeout=10)
        assert body.status_code == 200
        data = body.content
        length = int.from_bytes(data[4:8], "big")
        header = msgspec.msgpack.decode(data[8 : 8 + length], type=TransferHeader)
        size, rest = header.block_bytes, data[8 + length :]
        assert header.keys == keys
        assert header.streamed == [where[k] for k in keys].count(Medium.SSD.value)
        assert len(rest) == 5 * size > 0
        assert [checksum(rest[i * size : (i + 1) * size]) for i in range(5)] == header.checksums
        # Serving moved nothing and holds nothing: the source's copies stay where they were.
        held = httpx.get(f"{src}/kv/keys", headers=AUTH, timeout=10).json()["blocks"]
        assert {k: m for m, ks in held.items() for k in ks if k in where} == where
        assert in_use(src) == 0
        stats = httpx.get(f"{src}/kv/stats", headers=AUTH, timeout=10).json()
        assert set(stats["in_use_by_medium"].values()) == {0}
        # The source read its SSD blocks as it streamed them, so the stream's pace was
        # its SSD's as much as the network's: not what dst publishes as its transfer
        # bandwidth (the router prices a peer's reads apart).
        only_memory_pulls_are_timed(dst, src, src)


@contextlib.contextmanager
def without_data_port(source: str) -> Iterator[str]:
    """A source URL with no KV data socket, so that pulls from it go over HTTP: it relays
    ``POST /kv/blocks`` to the worker at ``source``, chunk by chunk as they come."""

    async def endpoint(request: Request) -> JSONResponse:
        return JSONResponse({"port": None})

    async def blocks(request: Request) -> StreamingResponse:
        client = httpx.AsyncClient(timeout=30)
        headers = {"content-type": "application/json", **AUTH}
        ask = client.build_request("POST", f"{source}/kv/blocks", content=await request.body(),
                                   headers=headers)  # fmt: skip
        answer = await client.send(ask, stream=True)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in answer.aiter_raw():
                    yield chunk
            finally:
                await answer.aclose()
                await client.aclose()

        return StreamingResponse(relay(), status_code=answer.status_code)

    routes = [Route("/kv/endpoint", endpoint), Route("/kv/blocks", blocks, methods=["POST"])]
    with serve_app(Starlette(routes=routes)) as url:
        yield url


def test_a_source_without_a_data_port_streams_its_ssd_copy_in_the_http_body(
    tmp_path: Path,
) -> None:
    # POST /kv/blocks (a source without a data socket) sends the header first and reads
    # each SSD block just before it goes, as the data socket does: a body held the run it
    # served whole, which for a window of 4,096 blocks is gigabytes.
    with workers(small_hbm(tmp_path), settings("dst")) as (src, dst):
        text = complete(src, LOW)["choices"][0]["text"]
        push_down(src)
        with without_data_port(src) as source:
            r = pull(dst, source, keys=LOW_KEYS)
            assert r.status_code == 200, r.text
            assert r.json()["pulled"] == 5
            # Paced by the source's SSD reads as much as by the network: not published.
            only_memory_pulls_are_timed(dst, src, source)
        pooled = complete(dst, LOW)
        assert pooled["choices"][0]["text"] == text
        assert pooled["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
        assert in_use(src) == 0


def only_memory_pulls_are_timed(dst: str, src: str, source: str) -> None:
    """``dst``, whose only pull so far streamed SSD blocks, publishes no bandwidth (0: none
    measured; the router takes its default) until it pulls blocks ``src`` holds in memory,
    from ``source`` (``src``, or a relay of it)."""
    assert transfer_bandwidth(dst) == 0
    fresh = list(range(4400, 4480))
    complete(src, fresh)
    r = pull(dst, source, keys=block_keys(fresh, 16, root_parent("tiny")))
    assert r.json()["pulled"] == 5
    assert transfer_bandwidth(dst) > 0


def transfer_bandwidth(url: str) -> float:
    value: float = httpx.get(f"{url}/worker/view", headers=AUTH, timeout=10).json()[
        "transfer_bandwidth"
    ]
    return value


def test_pulls_of_lower_tier_copies_while_the_source_churns_its_tiers_stay_exact(
    tmp_path: Path,
) -> None:
    # A source with little HBM serves its SSD copies while its own traffic demotes,
    # evicts and promotes (the pulled prompts are asked again there too, so the blocks
    # being read may be promoted under the sender's pins; test_kv_transfer makes that
    # happen for sure): every pull is whole and exact, every output unchanged, and no
    # pin outlives its transfer.
    pulled = [list(range(3300 + 90 * i, 3380 + 90 * i)) for i in range(4)]  # 5 blocks each
    busy = [[(37 * j + 11 * k) % 900 + 1 for k in range(150)] for j in range(6)]
    tiers = {"hbm_blocks": 16, "dram_blocks": 4, "ssd_blocks": 256, "ssd_path": tmp_path,
             "max_model_len": 176}  # fmt: skip
    with workers(settings("a", **tiers), settings("b"), settings("c")) as (a, b, c):
        refs = [complete(c, p)["choices"][0]["text"] for p in pulled]
        fresh = [complete(c, q, max_tokens=12)["choices"][0]["text"] for q in busy]
        for p in pulled:
            complete(a, p)
        with ThreadPoolExecutor(12) as pool:
            loads = [pool.submit(complete, a, q, 12) for q in busy]
            again = [pool.submit(complete, a, p) for p in pulled]
            pull_whole(pool, b, a, pulled)
            assert [f.result()["choices"][0]["text"] for f in loads] == fresh
            assert [f.result()["choices"][0]["text"] for f in again] == refs
        decode_pulled(b, pulled, refs)
        for url in (a, b):
            stats = httpx.get(f"{url}/kv/stats", headers=AUTH, timeout=10).json()
            assert set(stats["in_use_by_medium"].values()) == {0}, stats


def test_transfers_need_the_internal_token(trio: list[str]) -> None:
    a, b, _ = trio
    complete(a)
    r = httpx.post(f"{a}/kv/blocks", json={"keys": KEYS}, timeout=10)
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    assert pull(b, a, headers={}).status_code == 401
    with workers(settings("other", internal_token="another")) as (other,):
        prompt = list(range(200, 248))
        complete(other, prompt, token="another")
        before = hbm_keys(b)
        r = pull(b, other, keys=block_keys(prompt, 16, root_parent("tiny")))
        # ``other`` refuses B's token: nothing imported, the failure counted by reason.
        assert r.status_code == 502
        assert r.json()["error"]["code"] == "auth"
        assert hbm_keys(b) == before
        assert metric(b, "kv_transfer_failures_total", 'reason="auth"') >= 1


def test_blocks_of_another_kv_layout_are_refused(trio: list[str]) -> None:
    _, b, _ = trio
    with workers(settings("half", kv_dtype="float16")) as (half,):
        prompt = list(range(300, 340))
        complete(half, prompt)
        other = block_keys(prompt, 16, root_parent("tiny"))
        r = pull(b, half, keys=other[:2])
        assert r.status_code == 502
        assert r.json()["error"]["code"] == "dtype"
        assert not set(other[:2]) & hbm_keys(b)


@contextlib.contextmanager
def tampering_source(data_port: int, tamper: Callable[[bytes], bytes]) -> Iterator[str]:
    """A source URL whose data socket relays a real worker's transfers, ``tamper``ed."""

    def relay(conn: socket.socket) -> None:
        with socket.create_connection(("127.0.0.1", data_port)) as up:
            frame = conn.recv(8, socket.MSG_WAITALL)
            body = conn.recv(int.from_bytes(frame[4:], "big"), socket.MSG_WAITALL)
            up.sendall(frame + body)
            answer = bytearray()
            while chunk := up.recv(1 << 20):
                answer += chunk
            conn.sendall(tamper(bytes(answer)))

    with tcp_listener(relay) as port:

        async def endpoint(request: Request) -> JSONResponse:
            return JSONResponse({"port": port})

        with serve_app(Starlette(routes=[Route("/kv/endpoint", endpoint)])) as url:
            yield url


def _flip(data: bytes) -> bytes:
    out = bytearray(data)
    out[-100] ^= 0x01
    return bytes(out)


@pytest.mark.parametrize(
    ("reason", "tamper"),
    [("checksum", _flip), ("truncated", lambda d: d[:-100]), ("trailing", lambda d: d + b"x")],
)
def test_a_tampered_transfer_is_refused_and_leaves_nothing_behind(
    trio: list[str], reason: str, tamper: Callable[[bytes], bytes]
) -> None:
    a, b, _ = trio
    case = ["checksum", "truncated", "trailing"].index(reason)
    prompt = [900 + case, *range(1000, 1063)]  # 4 full blocks, one prompt per case
    complete(a, prompt)
    keys = block_keys(prompt, 16, root_parent("tiny"))
    port = httpx.get(f"{a}/kv/endpoint", headers=AUTH, timeout=10).json()["port"]
    before = hbm_keys(b)
    failures = metric(b, "kv_transfer_failures_total", f'reason="{reason}"')
    with tampering_source(port, tamper) as source:
        r = pull(b, source, keys=keys)
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == reason
    # Nothing of it is cached, and the blocks it was received into are free again.
    assert hbm_keys(b) == before
    assert in_use(b) == 0
    assert in_use(a) == 0  # the source let go of the blocks it sent
    assert metric(b, "kv_transfer_failures_total", f'reason="{reason}"') == failures + 1
    # Straight from the source, the same blocks come through and are used.
    r = pull(b, a, keys=keys)
    assert r.status_code == 200, r.text
    assert r.json()["pulled"] == len(keys)
    assert set(keys) <= hbm_keys(b)
    assert in_use(b) == 0


def test_the_published_bandwidth_leaves_out_the_sources_time_before_its_first_byte() -> None:
    # A source may take its time before the header (SSD blocks whose checksum it lacks
    # are read and hashed first), and the router prices its reads per source
    # (policies.cost_model.peer_read_seconds). Folded into the bandwidth, one pull of a
    # peer's SSD copy made every later pull, from any peer's HBM, look as slow as that
    # SSD. The relay holds the source's answer back for a second, as a slow read would.
    delay = 1.0
    prompt = list(range(2000, 2080))  # 5 full blocks

    def slow(data: bytes) -> bytes:
        time.sleep(delay)
        return data

    with workers(settings("src"), settings("dst")) as (src, dst):
        complete(src, prompt)
        keys = block_keys(prompt, 16, root_parent("tiny"))
        port = httpx.get(f"{src}/kv/endpoint", headers=AUTH, timeout=10).json()["port"]
        with tampering_source(port, slow) as source:
            r = pull(dst, source, keys=keys)
        assert r.status_code == 200, r.text
        result = r.json()
        assert result["pulled"] == len(keys)
        assert result["seconds"] >= delay  # the pull itself took the wait
        view = httpx.get(f"{dst}/worker/view", headers=AUTH, timeout=10).json()
        assert view["transfer_bandwidth"] > 0
        # The bytes at the published bandwidth take a fraction of the wait (timed end
        # to end, they took all of it), and the next heartbeat's metric says the same.
        assert result["bytes"] / view["transfer_bandwidth"] < delay / 4
        deadline = time.monotonic() + 5
        while not (published := metric(dst, "kv_transfer_bandwidth_bytes_per_second")):
            assert time.monotonic() < deadline, "the heartbeat never set the metric"
            time.sleep(0.1)
        assert published == pytest.approx(view["transfer_bandwidth"])
        # The blocks are used: the output is the source's, token for token.
        text = complete(src, prompt)["choices"][0]["text"]
        assert complete(dst, prompt)["choices"][0]["text"] == text


def test_a_sim_workers_pull_takes_and_publishes_the_modeled_time() -> None:
    # Sim blocks are placeholders of a few bytes: timed, they would publish a bandwidth
    # that prices the profile's real KV bytes thousands of times too slow.
    prompt = list(range(40, 40 + 64 * 16))
    keys = block_keys(prompt, 16, root_parent("tiny"))
    sim = {"runner": "sim", "max_model_len": 2048, "hbm_blocks": 128, "time_scale": 2.0,
           "sim_transfer_bandwidth": 2e9}  # fmt: skip
    with workers(settings("src", **sim), settings("dst", **sim)) as (src, dst):
        complete(src, prompt, max_tokens=1)
        r = pull(dst, src, keys)
        assert r.status_code == 200, r.text
        assert r.json()["pulled"] == 64
        # Llama-3-8B/H100 profile: 128 KiB of KV per token; 1,024 tokens at 2 GB/s, x2.
        modeled = 64 * 16 * 131072 / 2e9
        assert r.json()["seconds"] >= 2 * modeled
        # Published in wall time, as its profile is: 2 GB/s modeled at time scale 2.
        assert metric(dst, "kv_transfer_bandwidth_bytes_per_second") == pytest.approx(1e9)
        view = httpx.get(f"{dst}/worker/view", headers=AUTH, timeout=10).json()
        assert view["transfer_bandwidth"] == pytest.approx(1e9)
        # Its steps take twice the modeled time, and so does what it publishes, chunked
        # at the step budget its scheduler runs (128 tokens), not the profile file's.
        h100 = msgspec.structs.replace(default_profile(), max_num_batched_tokens=128)
        published = msgspec.convert(view["profile"], TimingProfile)
        assert published.max_num_batched_tokens == 128
        assert published.prefill_seconds(4096) == pytest.approx(2 * h100.prefill_seconds(4096))
        assert published.decode_seconds(8, 8192) == pytest.approx(2 * h100.decode_seconds(8, 8192))


def test_a_sim_workers_ssd_blocks_are_pulled_no_faster_than_its_ssd_reads() -> None:
    # As the offline simulator times a pull: the source streams what it reads, so a
    # prefix on its SSD takes the profile's SSD read time (6 GB/s on the H100 profile),
    # however fast the network. Without it a peer's SSD copy was cheaper to pull than
    # to load, and live runs disagreed with offline ones.
    first = list(range(40, 40 + 64 * 16))
    other = list(range(5000, 5000 + 64 * 16))
    keys = block_keys(first, 16, root_parent("tiny"))
    sim = {"runner": "sim", "max_model_len": 1100, "time_scale": 2.0,
           "sim_transfer_bandwidth": 1e11}  # fmt: skip
    source = settings("src", hbm_blocks=80, dram_blocks=0, ssd_blocks=256, **sim)
    with workers(source, settings("dst", hbm_blocks=128, **sim)) as (src, dst):
        complete(src, first, max_tokens=1)
        complete(src, other, max_tokens=1)  # 64 more blocks push the first prompt to SSD
        held = httpx.get(f"{src}/kv/keys", headers=AUTH, timeout=10).json()["blocks"]
        on_ssd = len(set(keys) & set(held.get(Medium.SSD.value, [])))
        assert on_ssd >= 48  # the tail first; the head may stay in HBM
        r = pull(dst, src, keys)
        assert r.status_code == 200, r.text
        assert r.json()["pulled"] == 64
        ssd_read = on_ssd * 16 * 131072 / 6e9  # >= 17 ms; the network alone: ~1.3 ms
        assert r.json()["seconds"] >= 2 * ssd_read
        # What it publishes is still the network's bandwidth (1e11 at time scale 2): the
        # router adds the peer's reads itself (policies.cost_model.peer_read_seconds).
        assert metric(dst, "kv_transfer_bandwidth_bytes_per_second") == pytest.approx(5e10)
        assert in_use(src) == 0


def test_pulled_blocks_are_announced_to_the_index(redis_url: str) -> None:
    with workers(settings("src"), settings("dst", redis_url=redis_url)) as (src, dst):
        complete(src)
        assert pull(dst, src).status_code == 200
        client = redis.Redis.from_url(redis_url)
        stored: set[int] = set()
        try:
            for _ in range(100):
                entries: Any = client.xrange(Keyspace().events("dst"))
                for _, fields in entries:
                    message = decode_message(fields[EVENT_FIELD])
                    if isinstance(message, EventBatch):
                        for event in message.events:
                            if isinstance(event, BlockStored) and event.medium is Medium.HBM:
                                stored.update(event.keys)
                if set(KEYS) <= stored:
                    break
                time.sleep(0.05)
        finally:
            client.close()
        assert set(KEYS) <= stored


def in_use(url: str) -> int:
    stats = httpx.get(f"{url}/kv/stats", headers=AUTH, timeout=10).json()
    n: int = stats["in_use_blocks"]
    return n


def pd_request(url: str, params: dict[str, Any], max_tokens: int = 6) -> httpx.Response:
    body = {
        "model": "tiny", "prompt": PD_PROMPT, "max_tokens": max_tokens, "temperature": 0,
        "kv_transfer_params": params,
    }  # fmt: skip
    return httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60)


PD_PROMPT = list(range(500, 580))  # 5 full blocks, not used by the other tests


def test_prefill_on_one_worker_and_decode_on_another_gives_the_colocated_tokens(
    trio: list[str],
) -> None:
    a, b, c = trio
    prefill = pd_request(a, {"do_remote_decode": True})
    assert prefill.status_code == 200, prefill.text
    body = prefill.json()
    params = body["kv_transfer_params"]
    keys = block_keys(PD_PROMPT, 16, root_parent("tiny"))
    assert params["do_remote_prefill"] is True
    assert params["remote_block_ids"] == keys
    assert params["remote_engine_id"] == "a"
    assert (params["remote_host"], params["num_tokens"]) == ("127.0.0.1", 80)
    assert body["usage"]["completion_tokens"] == 1
    # The prompt's 5 blocks stay referenced on A until a decoder pulls them.
    assert in_use(a) == 5
    assert metric(a, "kv_leases") == 1

    decoded = pd_request(b, params)
    assert decoded.status_code == 200, decoded.text
    colocated = pd_request(c, {})
    assert decoded.json()["choices"][0]["text"] == colocated.json()["choices"][0]["text"]
    assert decoded.json()["choices"][0]["text"].startswith(body["choices"][0]["text"])
    assert decoded.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    # The 64 cached tokens came from A: usage reports them as pulled from a peer.
    assert decoded.json()["usage"]["cached_tokens_by_medium"]["remote"] == 64
    assert decoded.json()["usage"]["cached_tokens_by_medium"]["hbm"] == 0
    # The pull released the lease: A holds nothing any more (its blocks stay cached).
    assert in_use(a) == 0
    assert set(keys) <= hbm_keys(a)


def test_an_unclaimed_lease_expires_and_frees_its_blocks() -> None:
    with workers(settings("p", lease_ttl_s=3.0)) as (p,):
        assert pd_request(p, {"do_remote_decode": True}).status_code == 200
        assert in_use(p) == 5
        deadline = time.monotonic() + 20
        while in_use(p) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert in_use(p) == 0
        assert metric(p, "kv_leases_expired_total") == 1


def test_a_decoder_whose_prefill_worker_is_gone_computes_the_prompt_itself(
    trio: list[str],
) -> None:
    _, b, c = trio
    dead = free_port()
    params = {
        "do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": dead,
        "remote_block_ids": block_keys(list(range(600, 680)), 16, root_parent("tiny")),
        "remote_request_id": "gone",
    }  # fmt: skip
    failures = metric(b, "kv_transfer_failures_total", 'reason="http"')
    body = {"model": "tiny", "prompt": list(range(600, 680)), "max_tokens": 5, "temperature": 0}
    r = httpx.post(
        f"{b}/v1/completions", json={**body, "kv_transfer_params": params}, headers=AUTH, timeout=60
    )
    assert r.status_code == 200, r.text
    expected = httpx.post(f"{c}/v1/completions", json=body, headers=AUTH, timeout=60).json()
    assert r.json()["choices"][0]["text"] == expected["choices"][0]["text"]
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert metric(b, "kv_transfer_failures_total", 'reason="http"') == failures + 1


def remote(**changes: Any) -> dict[str, Any]:
    base = {"do_remote_prefill": True, "remote_host": "h", "remote_port": 80}
    return {**base, "remote_block_ids": [], **changes}


@pytest.mark.parametrize(
    ("params", "extra", "message"),
    [
        ({"do_remote_decode": True}, {"stream": True}, "cannot be streamed"),
        ({"do_remote_decode": "yes"}, {}, "must be booleans"),
        (remote(remote_port=0), {}, "remote_port"),
        (remote(remote_host="h/x"), {}, "remote_host"),
        (remote(remote_block_ids=[-1]), {}, "remote_block_ids"),
    ],
)
def test_malformed_kv_transfer_params_are_a_400(
    trio: list[str], params: dict[str, Any], extra: dict[str, Any], message: str
) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "kv_transfer_params": params}
    r = httpx.post(f"{trio[0]}/v1/completions", json={**body, **extra}, headers=AUTH, timeout=30)
    assert r.status_code == 400
    assert message in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "kv_transfer_params" or message == "cannot be streamed"
