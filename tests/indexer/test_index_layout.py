"""The Redis index layout: bucket sizing, key packing, compact encodings on a default Redis."""

from __future__ import annotations

import random

import pytest
import redis

from indexer.events import Snapshot
from indexer.index import IndexLayout, InvalidKeyError, RedisIndex
from indexer.index.layout import pack_keys, unpack_holders
from indexer.media import Medium


def test_sized_layout_aims_at_64_fields_per_bucket() -> None:
    layout = IndexLayout.sized_for(blocks=4_000_000, blocks_per_host=250_000)
    assert (layout.key_bits, layout.host_bits, layout.group_bits) == (16, 12, 8)
    assert 4_000_000 / 2**layout.key_bits <= 64
    small = IndexLayout.sized_for(blocks=10, blocks_per_host=10)
    assert small.key_bits == small.host_bits == small.group_bits == 8


@pytest.mark.parametrize("bits", [(-1, 12, 8), (25, 12, 8), (16, 12, 13), (8, 4, 6)], ids=str)
def test_bad_layouts_are_refused(bits: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError, match="bits"):
        IndexLayout(*bits)


def test_keys_pack_big_endian_and_bad_ones_are_refused() -> None:
    assert pack_keys([1, 2**64 - 1]) == b"\0" * 7 + b"\1" + b"\xff" * 8
    for bad in ([2**64], [-1], [1.5]):
        with pytest.raises(InvalidKeyError):
            pack_keys(bad)  # type: ignore[arg-type]
    assert unpack_holders(bytes([0, 0, 5, 0xFF, 0xFF, 0xFE])) == {1: 1, (1 << 22) - 1: 2}


async def test_sized_buckets_stay_listpack_on_a_default_redis(redis_url: str) -> None:
    rng = random.Random(7)
    hosts = 4
    per_host = [[rng.getrandbits(64) for _ in range(3000)] for _ in range(hosts)]
    shared = [rng.getrandbits(64) for _ in range(1000)]
    layout = IndexLayout.sized_for(blocks=13_000, blocks_per_host=4000, group_bits=4)
    idx = RedisIndex(redis_url, layout=layout)
    try:
        for h, keys in enumerate(per_host):
            blocks = {Medium.HBM: keys + shared[: 250 * (h + 1)]}
            await idx.replace(Snapshot(f"w{h}", 1, 0, 0.0, blocks))
    finally:
        await idx.close()
    client = redis.Redis.from_url(redis_url)
    try:
        encodings = {
            client.object("encoding", key)
            for key in client.scan_iter(match="kvr:idx:{*}:[fr]:*", count=1000)
        }
    finally:
        client.close()
    assert encodings == {b"listpack"}
