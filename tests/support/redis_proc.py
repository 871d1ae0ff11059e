"""Tests use the product's own embedded Redis launcher (a real redis-server, never a mock)."""

from kvrouter.embedded_redis import EmbeddedRedis as RedisProcess
from kvrouter.embedded_redis import free_port

__all__ = ["RedisProcess", "free_port"]
