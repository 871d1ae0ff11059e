"""Longest cached prefix per host, from each key's holders in chain order.

Pure: the in-memory index walks its dict with it, the Redis Cluster
backend combines the nodes' per-key answers with it, and the single-node
Lua script (``match.lua``) does the same walk inside Redis.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from indexer.views import PrefixMatch

__all__ = ["longest_prefixes", "to_matches"]

#: Per host: [blocks, on hbm, on dram, on ssd].
PrefixCounts = dict[int, list[int]]


def longest_prefixes(holders: Iterable[Mapping[int, int] | None]) -> PrefixCounts:
    """Walk a chain's keys in order and count each host's matched prefix.

    Args:
        holders: For each key of the chain, in order, ``{host_id: medium rank}``
            of the hosts holding it (None or empty if nobody does). Consumed
            lazily: the walk stops at the first key no surviving host holds,
            so a generator over a large chain costs only the matched part.

    Returns:
        ``{host_id: [blocks, hbm, dram, ssd]}`` for every host whose prefix is
        at least one block long.
    """
    it = iter(holders)
    first = next(it, None)
    if not first:
        return {}
    alive: PrefixCounts = {}
    for hid, rank in first.items():
        st = [1, 0, 0, 0]
        st[1 + rank] = 1
        alive[hid] = st
    done: PrefixCounts = {}
    for here in it:
        if not here:
            break
        for hid in list(alive):
            got = here.get(hid)
            if got is None:
                done[hid] = alive.pop(hid)
            else:
                st = alive[hid]
                st[0] += 1
                st[1 + got] += 1
        if not alive:
            break
    done.update(alive)
    return done


def to_matches(counts: PrefixCounts, names: Mapping[int, str]) -> dict[str, PrefixMatch]:
    """Name the hosts of :func:`longest_prefixes` (ids without a name are skipped)."""
    out: dict[str, PrefixMatch] = {}
    for hid, (blocks, hbm, dram, ssd) in counts.items():
        name = names.get(hid)
        if name is not None:
            out[name] = PrefixMatch(name, blocks, (hbm, dram, ssd))
    return out
