"""PD ``auto`` with pooling through the gateway: when the plan moves a request off the
busy worker that holds its prefix onto a decode worker, the decoder pulls that prefix
instead of computing it (real Redis, indexer, sim workers)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis as sync_redis

from indexer.keys import block_keys, root_parent
from tests.kvrouter.test_gateway_pd import metric
from tests.kvrouter.test_gateway_pooling import (
    BLOCK,
    DEBUG,
    PREFIX,
    SLOW,
    busy,
    complete,
    wait_indexed,
)
from tests.support.cluster import Cluster, run_cluster, run_ingester


@pytest.fixture(scope="module")
def cluster(redis_server: Any) -> Iterator[Cluster]:
    redis_server.start()
    sync_redis.Redis.from_url(redis_server.url).flushall()
    gateway = {"pd": "auto", "pooling": True}
    roles = ("both", "decode")
    with (
        run_ingester(redis_server.url),
        run_cluster(redis_server.url, worker=SLOW, gateway=gateway, roles=roles) as c,
    ):
        yield c


def test_the_decoder_the_plan_moves_a_request_to_pulls_the_prefix_it_lacks(
    cluster: Cluster,
) -> None:
    holder, decoder = cluster.workers["w0"], cluster.workers["w1"]
    # w0 (prefill and decode) computes the prefix, sent to it directly.
    first = complete(holder, [*PREFIX, 7, 8, 9])
    assert first.status_code == 200, first.text
    keys = block_keys(PREFIX, BLOCK, root_parent("tiny"))
    wait_indexed(cluster, "w0", keys)
    with busy(cluster, "w0"):
        received = metric(decoder, "kvworker_kv_transfer_blocks_total", 'direction="received"')
        r = complete(cluster.gateway, [*PREFIX, 4, 5, 6], DEBUG)
        assert r.status_code == 200, r.text
        decision = json.loads(r.headers["x-kvrouter-decision"])
        # The policy chose w0 (the only worker that takes whole requests); the plan ran
        # the request on the idle decoder, pulling w0's prefix.
        assert decision["worker"] == "w1"
        assert decision["pd"]["mode"] == "colocated", decision["pd"]
        assert (decision["pd"]["prefill"], decision["pd"]["kv_source"]) == ("w1", "w0")
        usage = r.json()["usage"]
        assert usage["cached_tokens_by_medium"]["remote"] == len(PREFIX)
        after = metric(decoder, "kvworker_kv_transfer_blocks_total", 'direction="received"')
        assert after - received == len(keys)
