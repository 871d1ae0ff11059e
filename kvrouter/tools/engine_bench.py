"""Worker-engine benchmarks, each a ratio measured side by side in one run.

1. TTFT of SmolLM2-135M on a ~2K-token prompt (``--prompt-tokens``), cold
   against a 90% prefix hit whose blocks sit in HBM, in DRAM and on SSD. TTFT
   is the wall time of the engine steps from admitting the request to its
   first sampled token: scheduling (which promotes DRAM/SSD blocks into HBM,
   one copy each), the forward passes of every prefill chunk
   (``--chunk`` = ``max_num_batched_tokens``), sampling.
2. Greedy decode throughput of our engine (scheduler + torch runner over the
   paged cache) against transformers' ``generate`` (dynamic KV cache) on the
   same CPU, the same SmolLM2 weights read from the same GGUF file by
   transformers itself, float32, the same torch thread count: batch 1 and 8,
   ``--new-tokens`` tokens after a 32-token prompt, prefill included.
3. The ``sim`` runner's step rate: scheduler + metadata-only block pool +
   ``SimRunner`` stepping a decode batch of 8 and of 64 and a mixed workload,
   against a loop that only calls ``TimingProfile.step_seconds``: the Python
   cost of one simulated step.

Every model step runs with ``--threads`` torch intra-op threads (default 1: on a
shared machine, spin-waiting threads make multi-threaded figures erratic).
The SSD tier is a file in a temporary directory, page-cache hot: SSD figures
measure our path (``preadv`` + copy), not the disk.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import torch
import typer

from engine_worker.block_pool import BlockPool, TierCapacity
from engine_worker.model.llama import LlamaModel
from engine_worker.model.registry import resolve, smollm2_gguf_path
from engine_worker.profile_fit import ProfileFitter
from engine_worker.profiles import default_profile
from engine_worker.request import Request, SamplingParams
from engine_worker.runners.sim import SimRunner
from engine_worker.runners.torch_runner import TorchRunner
from engine_worker.scheduler import Scheduler, SchedulerConfig
from engine_worker.tiers import TierStorage
from indexer.keys import root_parent
from indexer.media import MEDIA, Medium
from kvrouter.tools.table import Row, RowFormat, report

__all__ = ["EngineCore", "bench_decode", "bench_sim", "bench_ttft", "main", "run"]

BLOCK_SIZE = 16
#: Share of the TTFT prompt served from the prefix cache (rounded down to whole blocks).
HIT_FRACTION = 0.9
DECODE_PROMPT_TOKENS = 32


@dataclass
class EngineCore:
    """One worker's engine without HTTP: tiers, pool, scheduler, torch runner."""

    storage: TierStorage
    pool: BlockPool
    scheduler: Scheduler
    runner: TorchRunner
    root: int

    @classmethod
    def build(
        cls,
        model: LlamaModel,
        capacity: TierCapacity,
        ssd_path: Path | None = None,
        *,
        chunk: int = 2048,
        max_num_seqs: int = 64,
    ) -> EngineCore:
        """Wire ``model`` to float32 KV tiers of ``capacity`` blocks, as the worker does."""
        config = model.config
        layout = config.kv_layout(BLOCK_SIZE, "float32")
        storage = TierStorage(layout, capacity, device=model.device, ssd_path=ssd_path)
        pool = BlockPool(capacity, storage)
        max_len = min(capacity.hbm * BLOCK_SIZE, config.max_position_embeddings)
        sched = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=chunk, max_model_len=max_len
        )
        fitter = ProfileFitter(
            name="bench",
            kv_bytes_per_token=layout.bytes_per_token,
            load_bandwidth={},
            max_num_batched_tokens=chunk,
        )
        runner = TorchRunner(model, storage.hbm, fitter=fitter)
        return cls(
            storage, pool, Scheduler(sched, pool, BLOCK_SIZE), runner, root_parent(config.name)
        )

    def request(self, request_id: str, prompt: Sequence[int], max_tokens: int) -> Request:
        """A greedy request that runs to ``max_tokens`` (EOS ignored)."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return Request(request_id, list(prompt), params, self.root, BLOCK_SIZE)

    def step(self) -> None:
        """Plan, execute and fold back one step."""
        plan = self.scheduler.schedule()
        if not plan.empty:
            self.scheduler.update(plan, self.runner.execute(plan).sampled)

    def run(self, requests: Sequence[Request]) -> float:
        """Add ``requests``, step until all finished; return the wall time."""
        t0 = time.perf_counter()
        for r in requests:
            self.scheduler.add(r)
        while self.scheduler.has_work():
            self.step()
        return time.perf_counter() - t0

    def ttft(self, request: Request) -> float:
        """Seconds from adding ``request`` to its first sampled token (run alone)."""
        t0 = time.perf_counter()
        self.scheduler.add(request)
        while not request.output_token_ids:
            self.step()
        seconds = time.perf_counter() - t0
        while self.scheduler.has_work():
            self.step()
        return seconds

    def prefix_media(self, request: Request, blocks: int) -> set[Medium]:
        """Media holding the first ``blocks`` cached blocks of ``request``'s prompt."""
        keys = request.ensure_keys(request.num_prompt_tokens)[:blocks]
        matched = self.pool.match_prefix(keys)
        if len(matched) < blocks:
            raise RuntimeError(f"only {len(matched)} of {blocks} prefix blocks are cached")
        return {b.medium for b in matched}

    def flush_hbm(self) -> None:
        """Evict every unused cached HBM block (demoting it), as a burst of other requests would."""
        self.pool.free(self.pool.allocate(self.pool.num_free())[::-1])

    def fill_hbm_with_other_keys(self, n: int, seed: int) -> None:
        """Cache ``n`` blocks under keys no prompt produces (other requests' blocks)."""
        blocks = self.pool.allocate(n)
        rng = random.Random(seed)
        for block in blocks:
            self.pool.cache_block(block, rng.getrandbits(64), None)
        self.pool.free(blocks[::-1])


def _tokens(n: int, seed: int, vocab_size: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab_size) for _ in range(n)]


def bench_ttft(
    model: LlamaModel, prompt_tokens: int, chunk: int, tmp: Path, repeat: int = 2
) -> tuple[list[Row], list[str]]:
    """TTFT cold vs a 90% prefix hit in HBM, DRAM and on SSD, on one worker; rows and notes.

    The prefix is computed once (the cold request), then placed on each medium
    in turn by evicting HBM wholesale (to DRAM) and then pushing DRAM's
    content down with blocks cached under unrelated keys (to SSD). Each hit
    is the best of ``repeat`` requests (new suffixes, media interleaved); the
    cold request runs once. The notes give the measured load bandwidth (what
    the heartbeat publishes) and the share of each hit's TTFT spent copying
    its prefix into HBM.
    """
    vocab = model.config.vocab_size
    prefix_blocks = int(prompt_tokens * HIT_FRACTION) // BLOCK_SIZE
    prefix = _tokens(prefix_blocks * BLOCK_SIZE, 1, vocab)
    suffix = prompt_tokens - len(prefix)
    hbm = max(256, 2 * -(-prompt_tokens // BLOCK_SIZE))
    capacity = TierCapacity(hbm=hbm, dram=hbm, ssd=hbm)
    core = EngineCore.build(model, capacity, tmp / "ssd", chunk=chunk)
    try:
        core.run([core.request("warmup", _tokens(64, 2, vocab), 2)])
        times: dict[Medium | None, float] = {}
        cold = core.request("cold", prefix + _tokens(suffix, 10, vocab), 1)
        times[None] = core.ttft(cold)
        for rep in range(repeat):
            for i, medium in enumerate(MEDIA):
                seed = 11 + i + len(MEDIA) * rep
                req = core.request(f"{medium}-{rep}", prefix + _tokens(suffix, seed, vocab), 1)
                if medium is not Medium.HBM:
                    core.flush_hbm()
                if medium is Medium.SSD:
                    core.fill_hbm_with_other_keys(capacity.dram, seed=seed)
                    core.flush_hbm()
                if core.prefix_media(req, prefix_blocks) != {medium}:
                    raise RuntimeError(f"the prefix is not on {medium} as planned")
                seconds = core.ttft(req)
                times[medium] = min(seconds, times.get(medium, seconds))
                if req.cached_by_medium()[medium] != len(prefix):
                    raise RuntimeError(f"the {medium} request did not hit its prefix")
        stats = core.storage.transfer_stats()
        bandwidth = core.storage.load_bandwidth()
    finally:
        core.storage.close()
    hit = f"{len(prefix) / prompt_tokens:.0%} hit"
    name = f"TTFT, {prompt_tokens}-token prompt, chunk {chunk}"
    rows = [Row(f"{name}, {hit} in {m.value}", "s", times[m], times[None], "cold") for m in MEDIA]
    notes = []
    for medium, bps in bandwidth.items():
        stat = stats[(medium, Medium.HBM)]
        per_hit = stat.seconds / stat.copies * prefix_blocks
        notes.append(
            f"{medium.value}->hbm: {stat.copies} blocks, {stat.bytes / 1e6:.1f} MB in "
            f"{stat.seconds * 1e3:.1f} ms ({stat.bytes / stat.seconds / 1e9:.2f} GB/s; heartbeat "
            f"figure {bps / 1e9:.2f} GB/s); per hit {per_hit * 1e3:.1f} ms, "
            f"{per_hit / times[medium]:.1%} of its best TTFT"
        )
    return rows, notes


def _transformers_model(path: Path) -> Any:
    """transformers' own reading of a GGUF file, float32 (as ``tests/.../model_refs.py``).

    ``from_pretrained(gguf_file=...)`` needs ``accelerate``; this calls the
    function it uses for the tensors (dequantize, undo llama.cpp's Q/K
    permutation) and the config class's GGUF parsing directly.
    """
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    hf: Any = LlamaForCausalLM(config)
    loader: Any = load_gguf_checkpoint
    tensors = loader(str(path), return_tensors=True, model_to_load=hf)["tensors"]
    missing, unexpected = hf.load_state_dict(tensors, strict=False)
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise RuntimeError(f"transformers' GGUF tensors: missing {missing}, extra {unexpected}")
    hf.tie_weights()
    return hf.float().eval()


def _hf_generate(hf: Any, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[Any]]:
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    seconds = time.perf_counter() - t0
    return seconds, out[:, ids.shape[1] :].tolist()


def bench_decode(
    model: LlamaModel, new_tokens: int, batches: Sequence[int] = (1, 8), repeat: int = 2
) -> tuple[list[Row], list[str]]:
    """Generated tokens/s, ours vs transformers ``generate``; also how many tokens agree.

    Each figure is the best of ``repeat`` runs, ours and transformers'
    alternating so that a load change on the machine hits both; every run
    has fresh prompts (so that our prefix cache never serves a repeated one).
    """
    hf = _transformers_model(smollm2_gguf_path())
    vocab = model.config.vocab_size
    core = EngineCore.build(model, TierCapacity(hbm=512))
    core.run([core.request("warmup", _tokens(DECODE_PROMPT_TOKENS, 3, vocab), 4)])
    _hf_generate(hf, [_tokens(DECODE_PROMPT_TOKENS, 3, vocab)], 4)
    rows: list[Row] = []
    notes: list[str] = []
    for b in batches:
        ours = theirs = float("inf")
        for rep in range(repeat):
            prompts = [
                _tokens(DECODE_PROMPT_TOKENS, 1000 * rep + 100 * b + i, vocab) for i in range(b)
            ]
            reqs = [core.request(f"d{b}-{rep}-{i}", p, new_tokens) for i, p in enumerate(prompts)]
            ours = min(ours, core.run(reqs))
            seconds, hf_out = _hf_generate(hf, prompts, new_tokens)
            theirs = min(theirs, seconds)
            if rep == 0:
                same = sum(
                    _agreeing_prefix(r.output_token_ids, h)
                    for r, h in zip(reqs, hf_out, strict=True)
                )
                notes.append(
                    f"batch {b}: {same}/{b * new_tokens} greedy tokens equal to transformers' "
                    "(per request, up to the first difference)"
                )
        total = b * new_tokens
        rows.append(
            Row(
                f"decode, batch {b}, {new_tokens} tokens after {DECODE_PROMPT_TOKENS}",
                "tokens/s",
                total / ours,
                total / theirs,
                "transformers generate",
            )
        )
    return rows, notes


def _agreeing_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _sim_core(hbm: int, dram: int = 0) -> tuple[Scheduler, SimRunner]:
    profile = default_profile()
    pool = BlockPool(TierCapacity(hbm=hbm, dram=dram))
    config = SchedulerConfig(
        max_num_seqs=64, max_num_batched_tokens=profile.max_num_batched_tokens, max_model_len=8192
    )
    return Scheduler(config, pool, BLOCK_SIZE), SimRunner(profile, BLOCK_SIZE)


def _sim_steps(sched: Scheduler, runner: SimRunner, steps: int) -> tuple[int, float]:
    """Step ``steps`` times (or until idle); (steps done, seconds)."""
    done = 0
    t0 = time.perf_counter()
    while done < steps and sched.has_work():
        plan = sched.schedule()
        sched.update(plan, runner.execute(plan).sampled)
        done += 1
    return done, time.perf_counter() - t0


def _baseline_rate(steps: int, chunks: list[tuple[int, int]], batch: int, kv: int) -> float:
    """Steps/s of a loop that only asks the profile for a step's duration."""
    profile = default_profile()
    t0 = time.perf_counter()
    for _ in range(steps):
        profile.step_seconds(chunks, batch, kv)
    return steps / (time.perf_counter() - t0)


def _mixed_workload(sched: Scheduler, root: int) -> None:
    """400 requests: 128-1536 own tokens, half behind one of 4 shared 512-token system prompts."""
    rng = random.Random(7)
    system = [_tokens(512, 1000 + g, 32000) for g in range(4)]
    for i in range(400):
        own = _tokens(rng.randint(128, 1536), 2000 + i, 32000)
        prompt = (system[rng.randrange(4)] if rng.random() < 0.5 else []) + own
        params = SamplingParams(max_tokens=rng.randint(16, 256))
        sched.add(Request(f"m{i}", prompt, params, root, BLOCK_SIZE))


def bench_sim(steps: int = 1000, repeat: int = 2) -> list[Row]:
    """Simulated steps/s of the real scheduler and pool against a bare profile-call loop.

    Every figure is the best of ``repeat`` runs. The decode batches start timing
    once every request decodes; the mixed workload runs to completion.
    """
    root = root_parent("sim")
    rows: list[Row] = []
    baseline = "loop of step_seconds()"
    for batch in (8, 64):
        sched, runner = _sim_core(hbm=batch * (8192 // BLOCK_SIZE))
        for i in range(batch):
            params = SamplingParams(max_tokens=8192 - 128)
            sched.add(Request(f"s{i}", _tokens(128, i, 32000), params, root, BLOCK_SIZE))
        while any(r.remaining_prefill > 1 for r in sched.running) or sched.waiting:
            _sim_steps(sched, runner, 1)
        ours = max(steps / _sim_steps(sched, runner, steps)[1] for _ in range(repeat))
        kv = batch * (128 + repeat * steps // 2)
        base = max(_baseline_rate(steps, [], batch, kv) for _ in range(repeat))
        rows.append(Row(f"sim steps, decode batch {batch}", "steps/s", ours, base, baseline))

    ours = 0.0
    for _ in range(repeat):
        sched, runner = _sim_core(hbm=4096, dram=8192)
        _mixed_workload(sched, root)
        done, seconds = _sim_steps(sched, runner, 10**9)
        ours = max(ours, done / seconds)
    base = max(_baseline_rate(done, [(1024, 512)], 48, 48 * 1024) for _ in range(repeat))
    name = f"sim steps, mixed (400 requests, {done} steps)"
    rows.append(Row(name, "steps/s", ours, base, baseline))
    return rows


def run(
    *,
    threads: int = 1,
    prompt_tokens: int = 2048,
    chunk: int = 2048,
    new_tokens: int = 64,
    sim_steps: int = 1000,
    repeat: int = 2,
) -> tuple[list[Row], list[str]]:
    """Run every engine benchmark with ``threads`` torch threads; rows and notes."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = resolve("smollm2").load()[1]
        with tempfile.TemporaryDirectory(prefix="kvbench-engine-") as tmp:
            rows, notes = bench_ttft(model, prompt_tokens, chunk, Path(tmp), repeat)
        decode, decode_notes = bench_decode(model, new_tokens, repeat=repeat)
        return rows + decode + bench_sim(sim_steps, repeat), notes + decode_notes
    finally:
        torch.set_num_threads(before)


def main(
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Also write the rows as JSON here.")
    ] = None,
    threads: Annotated[int, typer.Option(help="torch intra-op threads for every model.")] = 1,
    prompt_tokens: Annotated[int, typer.Option(help="TTFT prompt length.")] = 2048,
    chunk: Annotated[
        int, typer.Option(help="max_num_batched_tokens: the prefill chunk size.")
    ] = 2048,
    new_tokens: Annotated[int, typer.Option(help="Tokens generated per decode request.")] = 64,
    sim_steps: Annotated[int, typer.Option(help="Timed steps per sim decode benchmark.")] = 1000,
    repeat: Annotated[
        int,
        typer.Option(help="Runs per TTFT hit, decode and sim figure; the best is kept."),
    ] = 2,
) -> None:
    """TTFT by prefix tier, decode tokens/s against transformers, sim runner steps/s."""
    started = time.perf_counter()
    rows, notes = run(
        threads=threads,
        prompt_tokens=prompt_tokens,
        chunk=chunk,
        new_tokens=new_tokens,
        sim_steps=sim_steps,
        repeat=repeat,
    )
    fmt = RowFormat(f"kvrouter engine benchmarks (one run, {threads} torch thread(s))")
    report(
        rows,
        fmt,
        started=started,
        json_path=json_path,
        notes=notes,
        footer=f"torch {torch.__version__}",
        envelope={"threads": threads},
        width=160,
    )


if __name__ == "__main__":
    typer.run(main)
