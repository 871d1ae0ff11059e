"""The index's Lua scripts: loaded once per process, run by SHA, reloaded on NOSCRIPT.

Each script is ``common.lua`` (shared helpers) followed by its own body,
under a Redis 7 shebang: ``allow-cross-slot-keys`` lets one call touch
every group a cluster node serves (all keys it touches are local to the
node it runs on), ``no-writes`` marks the lookups as read-only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import NoScriptError

__all__ = ["SCRIPTS", "Args", "LuaScript", "run_script"]

#: A script's ARGV.
Args = list[str | bytes]


@dataclass(frozen=True, slots=True)
class LuaScript:
    """One script's full text and its SHA1 (what EVALSHA names)."""

    name: str
    text: str
    sha: str

    @classmethod
    def load(cls, name: str, *, read_only: bool = False) -> LuaScript:
        """Assemble ``<name>.lua`` from the package with the shared prelude."""
        pkg = resources.files("indexer.index")
        flags = "no-writes,allow-cross-slot-keys" if read_only else "allow-cross-slot-keys"
        text = (
            f"#!lua flags={flags}\n"
            + pkg.joinpath("common.lua").read_text(encoding="utf-8")
            + pkg.joinpath(f"{name}.lua").read_text(encoding="utf-8")
        )
        return cls(name, text, hashlib.sha1(text.encode()).hexdigest())


@dataclass(frozen=True, slots=True)
class _Scripts:
    apply: LuaScript
    replace: LuaScript
    purge: LuaScript
    match: LuaScript
    values: LuaScript


#: Every script of the index, assembled at import.
SCRIPTS = _Scripts(
    apply=LuaScript.load("apply"),
    replace=LuaScript.load("replace"),
    purge=LuaScript.load("purge"),
    match=LuaScript.load("match", read_only=True),
    values=LuaScript.load("values", read_only=True),
)


async def run_script(
    client: aioredis.Redis | RedisCluster,
    script: LuaScript,
    args: Sequence[str | bytes],
    node: ClusterNode | None = None,
) -> Any:
    """EVALSHA ``script`` with no KEYS and ``args``; EVAL (which caches it) on NOSCRIPT.

    Args:
        client: A single-node client, or a cluster client together with ``node``.
        script: The script to run.
        args: Its ARGV.
        node: The cluster node to run on (every key the call touches lives there).
    """
    if node is None:
        try:
            return await client.execute_command("EVALSHA", script.sha, 0, *args)
        except NoScriptError:
            return await client.execute_command("EVAL", script.text, 0, *args)
    try:
        return await client.execute_command("EVALSHA", script.sha, 0, *args, target_nodes=node)
    except NoScriptError:
        return await client.execute_command("EVAL", script.text, 0, *args, target_nodes=node)
