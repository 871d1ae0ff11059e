"""A non-streaming request's first token, as the gateway counts it (real Redis, gateway
and ``sim`` workers on loopback).

Before its first token a request's prompt is queued for prefill on its worker; after
it, the worker decodes it. The gateway counts each request on one side or the other
(the load every routing decision adds to the heartbeats), so it must see that moment
for non-streaming requests too, not only when their whole answer comes back.
"""

from __future__ import annotations

import asyncio
import threading
from contextlib import ExitStack

import httpx

from tests.kvrouter.test_gateway_pd import metric
from tests.kvrouter.test_reliability import (
    MODEL,
    gauges,
    hang_up_before_first_byte,
    prompt,
    published_in_flight,
    start_gateway,
    start_workers,
    wait_until,
)


def test_a_non_streaming_request_counts_as_decoding_from_its_first_token(
    redis_url: str,
) -> None:
    """While a non-streaming answer is still being generated, the gateway counts its
    prompt as prefilled (no queued tokens, its blocks held), and its TTFT metric records
    the first token, not the end of the answer."""
    with ExitStack() as stack:
        start_workers(stack, redis_url, 1, heartbeat_interval_s=0.2)
        gw = start_gateway(stack, 1, redis_url=redis_url)
        # A long stop string holds the answer's text back: the first token is marked all
        # the same.
        body = {
            "model": MODEL, "prompt": prompt(0, 1000), "max_tokens": 40, "temperature": 0,
            "ignore_eos": True,
            "stop": ["no such text " * 8],
        }  # fmt: skip
        answers: list[httpx.Response] = []
        call = threading.Thread(
            target=lambda: answers.append(
                httpx.post(f"{gw}/v1/completions", json=body, timeout=120)
            )
        )
        call.start()
        try:

            def decoding() -> bool:
                """the gateway counts the request in flight, prefilled, its blocks held"""
                scrape = httpx.get(f"{gw}/metrics").text
                return (
                    gauges(scrape, "kvrouter_worker_in_flight").get("w0") == 1
                    and gauges(scrape, "kvrouter_worker_queued_prefill_tokens").get("w0") == 0
                    and gauges(scrape, "kvrouter_worker_held_blocks").get("w0", 0) >= 1000 // 16
                )

            wait_until(decoding, timeout=30)
            assert call.is_alive(), "the answer was complete before the gateway saw it decode"
        finally:
            call.join()
        (answer,) = answers
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 40
        assert metric(gw, "kvrouter_time_to_first_token_seconds_count") == 1
        ttft = metric(gw, "kvrouter_time_to_first_token_seconds_sum")
        e2e = metric(gw, "kvrouter_e2e_request_latency_seconds_sum")
        # 40 decode steps follow the first token: most of the answer's time comes after it.
        assert 0 < ttft < e2e / 2
        assert metric(gw, "kvrouter_ttft_prediction_ratio_count") == 1


def test_a_non_streaming_client_that_leaves_mid_generation_stops_it_on_the_worker(
    redis_url: str,
) -> None:
    """A non-streaming client hangs up while its answer is being generated, past its
    first token: the worker aborts it within a step or so (200 tokens would take ~20 s),
    and neither the worker nor the gateway counts it any longer."""
    with ExitStack() as stack:
        (worker,) = start_workers(stack, redis_url, 1, heartbeat_interval_s=0.2).values()
        gw = start_gateway(stack, 1, redis_url=redis_url)
        body = {"model": MODEL, "prompt": prompt(1, 1000), "max_tokens": 200, "ignore_eos": True}
        # 1,000 tokens prefill in ~1 s at this time scale; the client leaves after 2.5 s.
        got = asyncio.run(hang_up_before_first_byte(gw, body, 2.5))
        assert got == b""  # nothing reached it: a non-streaming answer comes whole

        def idle() -> bool:
            """the worker publishes 0 in flight and the gateway counts 0 in flight"""
            scrape = httpx.get(f"{gw}/metrics").text
            counted = gauges(scrape, "kvrouter_worker_in_flight")
            return published_in_flight(redis_url) == {"w0": 0} and counted.get("w0") == 0

        wait_until(idle, timeout=3.0)
        # It had its first token (the worker timed it) and was aborted, not finished.
        assert metric(worker, "kvworker_time_to_first_token_seconds_count") == 1
        assert (
            metric(worker, "kvworker_requests_total", '{endpoint="completions",reason="abort"}')
            == 1
        )
