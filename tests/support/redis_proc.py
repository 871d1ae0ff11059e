"""Tests use the product's own embedded Redis launcher (a real redis-server, never a mock)."""

from kvrouter.embedded_redis import EmbeddedRedis, free_port

__all__ = ["RedisProcess", "free_port"]


class RedisProcess(EmbeddedRedis):
    """The embedded Redis, not tied to the spawning thread: fault tests restart it from
    worker threads, which exit long before the test session ends."""

    def __init__(self, port: int | None = None, *, extra_args: tuple[str, ...] = ()) -> None:
        super().__init__(port, extra_args=extra_args, tied_to_parent=False)
