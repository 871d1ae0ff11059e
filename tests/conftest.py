"""Shared fixtures: a real redis-server per test session, flushed between tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from tests.support.redis_proc import RedisProcess


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisProcess]:
    """One throwaway redis-server for the whole session."""
    server = RedisProcess()
    server.start()
    yield server
    server.close()


@pytest.fixture
def redis_url(redis_server: RedisProcess) -> str:
    """URL of the session's Redis, emptied before each test (restarted if a test killed it)."""
    redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url
