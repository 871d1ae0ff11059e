"""Synthetic workloads written as traces (:mod:`kvrouter.bench.trace`), deterministic per seed.

Three shapes that stress KV-cache-aware routing differently:

* :class:`ChatWorkload` -- multi-turn chat: sessions arrive as a Poisson
  process; turn ``k``'s prompt is the shared system prompt, every earlier user
  message and answer, and the new user message; turns of a session are
  separated by a think time.
* :class:`GroupsWorkload` -- shared-prefix groups, as llm-d's "prefix cache
  aware routing" benchmark (inference-perf's ``shared_prefix`` data: groups x
  prompts per group, each prompt a group system prompt plus a question): G
  groups of U users, user ``u`` of group ``g`` always asks its own question
  after the group's system prompt; requests pick a (group, user) uniformly and
  arrive as a Poisson process of rate R.
* :class:`AgentWorkload` -- agent loops: long contexts (a shared tool-definition
  prompt plus an 8-32K task context) that grow by a short answer and a few
  hundred tokens of tool output per step, for many steps.

Hash ids follow :mod:`kvrouter.bench.streams`: a conversation is an
append-only stream of 512-token blocks, and shared content (a system prompt)
shares only its whole blocks, so pick shared lengths that are multiples of
512 to share them exactly. :mod:`kvrouter.bench.production` adds two families
shaped like production traces (heavy-tailed lengths, bursts).

Lengths drawn "around a mean" are uniform integers in ``[mean/2, 3*mean/2]``
(at least 1), think times and agent step intervals uniform in the same range:
a person reads before typing and a tool takes time, so a gap is never close to
zero (an exponential gap would often send turn ``k+1`` before turn ``k`` is
answered). Session and agent starts and group requests are Poisson. Arrival
times are open loop: a turn's time does not depend on when the previous answer
finished, as in Mooncake's traces. The generator draws from
:class:`random.Random` (stable across Python versions).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass

from kvrouter.bench.production import (
    ConversationWorkload,
    MixedWorkload,
    generate_conversation,
    generate_mixed,
)
from kvrouter.bench.streams import TokenStream, WorkloadError, check_positive, shared_stream
from kvrouter.bench.trace import TraceRecord

__all__ = [
    "AgentWorkload",
    "ChatWorkload",
    "ConversationWorkload",
    "GroupsWorkload",
    "MixedWorkload",
    "Workload",
    "WorkloadError",
    "generate",
]


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    """Multi-turn chat sessions.

    Attributes:
        sessions: Sessions (S).
        turns: Turns per session (T).
        system_tokens: System prompt shared by every session.
        user_tokens: Mean user message length.
        answer_tokens: Mean answer length (the turn's ``output_length``).
        think_time_s: Mean time between a session's turns.
        session_rate: Sessions started per second (Poisson).
    """

    sessions: int = 200
    turns: int = 6
    system_tokens: int = 1024
    user_tokens: int = 256
    answer_tokens: int = 256
    think_time_s: float = 20.0
    session_rate: float = 2.0

    def __post_init__(self) -> None:
        check_positive(
            sessions=self.sessions,
            turns=self.turns,
            user_tokens=self.user_tokens,
            answer_tokens=self.answer_tokens,
            think_time_s=self.think_time_s,
            session_rate=self.session_rate,
        )
        if self.system_tokens < 0:
            raise WorkloadError(f"system_tokens must be >= 0, got {self.system_tokens}")


@dataclass(frozen=True, slots=True)
class GroupsWorkload:
    """Shared-prefix groups.

    Attributes:
        groups: Groups (G), each with its own system prompt.
        users: Users per group (U), each with its own question.
        system_tokens: Group system prompt length (S).
        question_tokens: Question length (Q).
        output_tokens: Mean answer length.
        rate: Requests per second (R, Poisson).
        requests: Requests in the trace.
    """

    groups: int = 16
    users: int = 16
    system_tokens: int = 4096
    question_tokens: int = 256
    output_tokens: int = 128
    rate: float = 20.0
    requests: int = 2000

    def __post_init__(self) -> None:
        check_positive(
            groups=self.groups,
            users=self.users,
            system_tokens=self.system_tokens,
            question_tokens=self.question_tokens,
            output_tokens=self.output_tokens,
            rate=self.rate,
            requests=self.requests,
        )


@dataclass(frozen=True, slots=True)
class AgentWorkload:
    """Agent loops over long, slowly growing contexts.

    Attributes:
        agents: Agents (each one conversation).
        steps: Model calls per agent.
        system_tokens: Tool definitions and instructions shared by every agent.
        context_min: Smallest first-step prompt (shared part included).
        context_max: Largest first-step prompt.
        tool_tokens_min: Smallest tool output appended after a step.
        tool_tokens_max: Largest tool output appended after a step.
        output_tokens: Mean answer length (short: a tool call).
        step_interval_s: Mean time between an agent's steps.
        agent_rate: Agents started per second (Poisson).
    """

    agents: int = 32
    steps: int = 20
    system_tokens: int = 2048
    context_min: int = 8192
    context_max: int = 32768
    tool_tokens_min: int = 100
    tool_tokens_max: int = 600
    output_tokens: int = 64
    step_interval_s: float = 4.0
    agent_rate: float = 0.5

    def __post_init__(self) -> None:
        check_positive(
            agents=self.agents,
            steps=self.steps,
            context_min=self.context_min,
            tool_tokens_min=self.tool_tokens_min,
            output_tokens=self.output_tokens,
            step_interval_s=self.step_interval_s,
            agent_rate=self.agent_rate,
        )
        if not 0 <= self.system_tokens < self.context_min <= self.context_max:
            raise WorkloadError("need 0 <= system_tokens < context_min <= context_max")
        if self.tool_tokens_max < self.tool_tokens_min:
            raise WorkloadError("tool_tokens_max must be >= tool_tokens_min")


Workload = ChatWorkload | GroupsWorkload | AgentWorkload | ConversationWorkload | MixedWorkload


def _around(rng: random.Random, mean: int) -> int:
    return max(1, rng.randint(mean // 2, mean + mean // 2))


def _gap(rng: random.Random, mean: float) -> float:
    return rng.uniform(mean / 2, 1.5 * mean)


def _chat(w: ChatWorkload, rng: random.Random, alloc: Callable[[], int]) -> list[TraceRecord]:
    system = shared_stream(alloc, w.system_tokens)
    out: list[TraceRecord] = []
    start = 0.0
    for _ in range(w.sessions):
        start += rng.expovariate(w.session_rate)
        stream, at = system.fork(), start
        stream.append(system.length - stream.length)
        for turn in range(w.turns):
            if turn:
                at += _gap(rng, w.think_time_s)
            stream.append(_around(rng, w.user_tokens))
            answer = _around(rng, w.answer_tokens)
            out.append(stream.record(at, answer))
            stream.append(answer)
    return out


def _groups(w: GroupsWorkload, rng: random.Random, alloc: Callable[[], int]) -> list[TraceRecord]:
    prompts: list[list[TokenStream]] = []
    for _ in range(w.groups):
        system = shared_stream(alloc, w.system_tokens)
        users = []
        for _ in range(w.users):
            stream = system.fork()
            stream.append(w.system_tokens - stream.length + w.question_tokens)
            users.append(stream)
        prompts.append(users)
    out: list[TraceRecord] = []
    at = 0.0
    for _ in range(w.requests):
        at += rng.expovariate(w.rate)
        stream = prompts[rng.randrange(w.groups)][rng.randrange(w.users)]
        out.append(stream.record(at, _around(rng, w.output_tokens)))
    return out


def _agents(w: AgentWorkload, rng: random.Random, alloc: Callable[[], int]) -> list[TraceRecord]:
    system = shared_stream(alloc, w.system_tokens)
    out: list[TraceRecord] = []
    start = 0.0
    for _ in range(w.agents):
        start += rng.expovariate(w.agent_rate)
        stream, at = system.fork(), start
        stream.append(rng.randint(w.context_min, w.context_max) - stream.length)
        for step in range(w.steps):
            if step:
                at += _gap(rng, w.step_interval_s)
            answer = _around(rng, w.output_tokens)
            out.append(stream.record(at, answer))
            stream.append(answer + rng.randint(w.tool_tokens_min, w.tool_tokens_max))
    return out


def generate(workload: Workload, seed: int = 0) -> list[TraceRecord]:
    """The workload's trace, sorted by arrival (generation order among equal times).

    The same workload and seed always give the same trace.

    Raises:
        WorkloadError: An unknown workload type.
    """
    rng = random.Random(seed)
    alloc = itertools.count().__next__
    if isinstance(workload, ChatWorkload):
        records = _chat(workload, rng, alloc)
    elif isinstance(workload, GroupsWorkload):
        records = _groups(workload, rng, alloc)
    elif isinstance(workload, AgentWorkload):
        records = _agents(workload, rng, alloc)
    elif isinstance(workload, ConversationWorkload):
        records = generate_conversation(workload, rng, alloc)
    elif isinstance(workload, MixedWorkload):
        records = generate_mixed(workload, rng, alloc)
    else:
        raise WorkloadError(f"unknown workload {type(workload).__name__}")
    return sorted(records, key=lambda r: r.timestamp)
