"""A prefix hit from any tier gives what a cold worker gives; copies into HBM are measured.

Each scenario warms a worker with ``PREFIX + SUFFIX_A``, moves the
prefix's blocks to a medium (by running other requests, as traffic would),
then asks ``PREFIX + SUFFIX_B`` and compares the logits of its first token
and its greedy continuation with a fresh worker that computes everything.
Tiny model in the fast suite, SmolLM2-135M in the slow one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

from engine_worker.block_pool import TierCapacity
from engine_worker.kv_socket import KvSocketServer, fetch_blocks
from engine_worker.kv_transfer import (
    Outgoing,
    Reservation,
    TransferHeader,
    expected_for,
    export_pinned,
    reserve_import,
)
from engine_worker.model.llama import LlamaModel
from engine_worker.model.registry import resolve
from engine_worker.tiers import TransferStat
from indexer.media import Medium
from tests.engine_worker.worker_core import (
    BLOCK_SIZE,
    WorkerCore,
    build_core,
    random_tokens,
    run_to_completion,
)

HBM, DRAM, SSD = Medium.HBM, Medium.DRAM, Medium.SSD
LOGIT_TOL = 1e-5
PREFIX_BLOCKS = 6
NEW_TOKENS = 4
FILLER_TOKENS = 200
HBM_BLOCKS = 16

MODELS = [
    pytest.param("tiny", id="tiny"),
    pytest.param("smollm2", id="smollm2", marks=pytest.mark.slow),
]


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread: on a shared 2-core machine two threads spin-wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def load_model() -> Iterator[Callable[[str], LlamaModel]]:
    """Loads each model once per module."""
    cache: dict[str, LlamaModel] = {}

    def load(name: str) -> LlamaModel:
        if name not in cache:
            cache[name] = resolve(name).load()[1]
        return cache[name]

    yield load
    cache.clear()


class Prompts:
    """A shared prefix, two suffixes that differ from their first token, and filler traffic."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.prefix = random_tokens(PREFIX_BLOCKS * BLOCK_SIZE, 1, vocab_size)
        self.warm = self.prefix + random_tokens(20, 2, vocab_size)
        self.query = self.prefix + random_tokens(20, 3, vocab_size)
        self._fillers = 0

    def filler(self) -> tuple[str, list[int]]:
        """A request id and a prompt sharing nothing with the others (new ones each call)."""
        self._fillers += 1
        n = self._fillers
        return f"filler-{n}", random_tokens(FILLER_TOKENS, 1000 + n, self.vocab_size)


def cold_answer(model: LlamaModel, prompts: Prompts) -> tuple[torch.Tensor, list[int]]:
    """First-token logits and greedy tokens of the query on a fresh worker."""
    core = build_core(model, TierCapacity(hbm=HBM_BLOCKS))
    req = run_to_completion(core, [core.request("cold", prompts.query, NEW_TOKENS)])["cold"]
    assert req.cached_by_medium() == {HBM: 0, DRAM: 0, SSD: 0}
    return core.sampler.first_logits["cold"], req.output_token_ids


def push_prefix_to(core: WorkerCore, prompts: Prompts, medium: Medium, max_fillers: int) -> None:
    """Run filler requests until every prefix block sits on ``medium``; fail if it never does."""
    for _ in range(max_fillers):
        if core.media_of(prompts.query) == [medium] * PREFIX_BLOCKS:
            return
        run_to_completion(core, [core.request(*prompts.filler())])
    assert core.media_of(prompts.query) == [medium] * PREFIX_BLOCKS


def ask(core: WorkerCore, prompts: Prompts, medium: Medium) -> tuple[torch.Tensor, list[int]]:
    """Run the query on ``core``; check that its whole prefix came from ``medium``."""
    req = run_to_completion(core, [core.request("hit", prompts.query, NEW_TOKENS)])["hit"]
    cached = req.cached_by_medium()
    assert cached[medium] == PREFIX_BLOCKS * BLOCK_SIZE
    assert sum(cached.values()) == PREFIX_BLOCKS * BLOCK_SIZE
    return core.sampler.first_logits["hit"], req.output_token_ids


def assert_same_answer(
    hit: tuple[torch.Tensor, list[int]], cold: tuple[torch.Tensor, list[int]]
) -> None:
    torch.testing.assert_close(hit[0], cold[0], atol=LOGIT_TOL, rtol=0)
    assert hit[1] == cold[1]


def pull_prefix(a: WorkerCore, b: WorkerCore, prompts: Prompts) -> int:
    """``b`` pulls the query's prefix blocks from ``a`` over the KV data socket (pinned
    send, reserved receive, checksums), as PD and pooling do; returns the blocks landed."""
    keys = a.request("probe", prompts.query).ensure_keys(len(prompts.query))[:PREFIX_BLOCKS]
    name, layout = a.config.name, a.storage.layout

    async def pull() -> int:
        async def export(asked: Sequence[int], release: str | None) -> Outgoing:
            return export_pinned(a.pool, a.storage, name, BLOCK_SIZE, asked)

        reservations: list[Reservation] = []

        async def land(header: TransferHeader) -> Sequence[memoryview]:
            reservations.append(reserve_import(b.pool, b.storage, header.parent, header.keys))
            return reservations[-1].views

        server = KvSocketServer(export, None, "127.0.0.1")
        await server.start()
        try:
            expected = expected_for(name, BLOCK_SIZE, layout, keys)
            await fetch_blocks("127.0.0.1", server.port, None, keys, None, expected, 30.0, land)
        finally:
            await server.stop()
        return reservations[0].commit()

    return asyncio.run(pull())


@pytest.mark.parametrize("model_name", MODELS)
def test_a_prefix_hit_in_hbm_answers_like_a_cold_worker(
    load_model: Callable[[str], LlamaModel], model_name: str
) -> None:
    model = load_model(model_name)
    prompts = Prompts(model.config.vocab_size)
    core = build_core(model, TierCapacity(hbm=HBM_BLOCKS))
    run_to_completion(core, [core.request("warm", prompts.warm)])
    assert core.media_of(prompts.query) == [HBM] * PREFIX_BLOCKS
    assert_same_answer(ask(core, prompts, HBM), cold_answer(model, prompts))


@pytest.mark.parametrize("model_name", MODELS)
def test_a_prefix_hit_in_dram_answers_like_a_cold_worker(
    load_model: Callable[[str], LlamaModel], model_name: str
) -> None:
    model = load_model(model_name)
    prompts = Prompts(model.config.vocab_size)
    core = build_core(model, TierCapacity(hbm=HBM_BLOCKS, dram=64))
    run_to_completion(core, [core.request("warm", prompts.warm)])
    push_prefix_to(core, prompts, DRAM, max_fillers=4)
    before = core.pool.stats().promotions[DRAM]
    answer = ask(core, prompts, DRAM)
    assert core.pool.stats().promotions[DRAM] - before == PREFIX_BLOCKS
    assert_same_answer(answer, cold_answer(model, prompts))


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize(
    "capacity",
    [
        pytest.param(TierCapacity(hbm=HBM_BLOCKS, ssd=64), id="no-dram"),
        pytest.param(TierCapacity(hbm=HBM_BLOCKS, dram=8, ssd=64), id="through-dram"),
    ],
)
def test_a_prefix_hit_on_ssd_answers_like_a_cold_worker(
    load_model: Callable[[str], LlamaModel],
    model_name: str,
    capacity: TierCapacity,
    tmp_path: Path,
) -> None:
    model = load_model(model_name)
    prompts = Prompts(model.config.vocab_size)
    core = build_core(model, capacity, tmp_path / "ssd")
    try:
        run_to_completion(core, [core.request("warm", prompts.warm)])
        push_prefix_to(core, prompts, SSD, max_fillers=6)
        answer = ask(core, prompts, SSD)
    finally:
        core.close()
    assert_same_answer(answer, cold_answer(model, prompts))


def test_a_prefix_on_ssd_survives_a_worker_restart(
    load_model: Callable[[str], LlamaModel], tmp_path: Path
) -> None:
    model = load_model("tiny")
    prompts = Prompts(model.config.vocab_size)
    capacity = TierCapacity(hbm=HBM_BLOCKS, ssd=64)
    first = build_core(model, capacity, tmp_path / "ssd")
    try:
        run_to_completion(first, [first.request("warm", prompts.warm)])
        push_prefix_to(first, prompts, SSD, max_fillers=4)
    finally:
        first.close()
    restarted = build_core(model, capacity, tmp_path / "ssd")
    try:
        assert restarted.media_of(prompts.query) == [SSD] * PREFIX_BLOCKS
        answer = ask(restarted, prompts, SSD)
    finally:
        restarted.close()
    assert_same_answer(answer, cold_answer(model, prompts))


@pytest.mark.parametrize("model_name", MODELS)
def test_a_prefix_pulled_from_another_worker_answers_like_a_cold_worker(
    load_model: Callable[[str], LlamaModel], model_name: str
) -> None:
    """Pooling and PD at the logits level: worker A computes the prefix, B pulls it over
    the KV data socket (pinned send, reserved receive, checksums) and answers."""
    model = load_model(model_name)
    prompts = Prompts(model.config.vocab_size)
    a = build_core(model, TierCapacity(hbm=HBM_BLOCKS))
    b = build_core(model, TierCapacity(hbm=HBM_BLOCKS))
    run_to_completion(a, [a.request("warm", prompts.warm)])
    assert pull_prefix(a, b, prompts) == PREFIX_BLOCKS
    assert b.media_of(prompts.query) == [HBM] * PREFIX_BLOCKS
    assert_same_answer(ask(b, prompts, HBM), cold_answer(model, prompts))


def test_the_comparison_notices_corrupted_cached_bytes(
    load_model: Callable[[str], LlamaModel],
) -> None:
    """Guards the tests above: a hit computed over wrong KV bytes must not pass for a cold run."""
    model = load_model("tiny")
    prompts = Prompts(model.config.vocab_size)
    core = build_core(model, TierCapacity(hbm=HBM_BLOCKS, dram=64))
    run_to_completion(core, [core.request("warm", prompts.warm)])
    push_prefix_to(core, prompts, DRAM, max_fillers=4)
    keys = core.request("probe", prompts.query).ensure_keys(len(prompts.query))
    last = core.pool.match_prefix(keys)[PREFIX_BLOCKS - 1]
    core.storage.dram[last.block_id].mul_(0.5)
    hit, cold = ask(core, prompts, DRAM), cold_answer(model, prompts)
    assert float((hit[0] - cold[0]).abs().max()) > 100 * LOGIT_TOL


# ----------------------------------------------------------------- measured bandwidth


def test_no_bandwidth_is_reported_before_any_copy(
    load_model: Callable[[str], LlamaModel], tmp_path: Path
) -> None:
    core = build_core(load_model("tiny"), TierCapacity(hbm=HBM_BLOCKS, dram=8, ssd=8), tmp_path)
    try:
        assert core.storage.transfer_stats() == {}
        assert core.storage.bandwidth(DRAM, HBM) is None
        assert core.storage.load_bandwidth() == {}
    finally:
        core.close()


@pytest.mark.parametrize("lower", [DRAM, SSD])
def test_copies_into_hbm_are_measured_per_medium(
    load_model: Callable[[str], LlamaModel], lower: Medium, tmp_path: Path
) -> None:
    model = load_model("tiny")
    prompts = Prompts(model.config.vocab_size)
    capacity = TierCapacity(hbm=HBM_BLOCKS, **{lower.value: 64})
    core = build_core(model, capacity, tmp_path / "ssd")
    try:
        run_to_completion(core, [core.request("warm", prompts.warm)])
        push_prefix_to(core, prompts, lower, max_fillers=4)
        assert core.storage.load_bandwidth() == {}
        ask(core, prompts, lower)
        stats = core.storage.transfer_stats()
        pool = core.pool.stats()
        block_bytes = core.storage.layout.block_bytes
        down, up = stats[(HBM, lower)], stats[(lower, HBM)]
        assert down.copies == pool.demotions[HBM] > 0
        assert up.copies == pool.promotions[lower] == PREFIX_BLOCKS
        assert up.bytes == PREFIX_BLOCKS * block_bytes
        assert up.seconds > 0
        assert set(stats) == {(HBM, lower), (lower, HBM)}
        bandwidth = core.storage.bandwidth(lower, HBM)
        assert bandwidth is not None
        assert bandwidth > 0
        assert core.storage.load_bandwidth() == {lower: bandwidth}
    finally:
        core.close()


def test_the_transfer_stats_returned_are_a_copy(
    load_model: Callable[[str], LlamaModel],
) -> None:
    model = load_model("tiny")
    prompts = Prompts(model.config.vocab_size)
    core = build_core(model, TierCapacity(hbm=HBM_BLOCKS, dram=64))
    run_to_completion(core, [core.request("warm", prompts.warm)])
    push_prefix_to(core, prompts, DRAM, max_fillers=4)
    before = core.storage.transfer_stats()[(HBM, DRAM)]
    before.copies = -1
    assert core.storage.transfer_stats()[(HBM, DRAM)].copies > 0


def test_bandwidth_follows_recent_copies() -> None:
    stat = TransferStat()
    assert stat.bandwidth is None
    for _ in range(10):
        stat.add(1000, 1e-6)
    assert stat.bandwidth == pytest.approx(1e9)
    for _ in range(200):
        stat.add(1000, 1e-7)
    assert stat.bandwidth == pytest.approx(1e10, rel=1e-3)
    assert stat.copies == 210
    assert stat.bytes == 210_000
    assert stat.seconds == pytest.approx(10 * 1e-6 + 200 * 1e-7)
