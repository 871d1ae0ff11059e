"""Render OpenAI chat ``messages`` into a prompt with the model's own Jinja template.

Behaves like transformers' ``apply_chat_template(..., tokenize=False)``: a
sandboxed Jinja environment with ``trim_blocks`` and ``lstrip_blocks``,
the ``raise_exception`` and ``strftime_now`` globals, a ``tojson`` filter
that keeps non-ASCII text, and ``bos_token`` / ``eos_token`` /
``add_generation_prompt`` / ``tools`` in the context. Messages are checked
and normalized first: list-of-parts content becomes one string (text parts
joined by newlines, as vLLM does for string-content templates).

No torch; the router renders prompts too, to hash the same tokens.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from engine_worker.tokenizer import Tokenizer

__all__ = ["ROLES", "ChatTemplate", "ChatTemplateError", "normalize_messages"]

#: Roles a message may have.
ROLES = frozenset({"system", "user", "assistant", "tool"})


class ChatTemplateError(ValueError):
    """Messages the template cannot render, or a template that does not compile."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _content_text(index: int, content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ChatTemplateError(
            f"messages[{index}].content must be a string or a list of parts, "
            f"got {type(content).__name__}"
        )
    texts = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ChatTemplateError(
                f"messages[{index}].content: only text parts are supported, got {kind!r}"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ChatTemplateError(f"messages[{index}].content: a text part needs a string 'text'")
        texts.append(text)
    return "\n".join(texts)


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check OpenAI-style messages and flatten their content to strings.

    Keys other than ``role`` and ``content`` (``name``, ``tool_calls``,
    ``tool_call_id``) are passed through for templates that use them.

    Raises:
        ChatTemplateError: Empty list, unknown role, or content that is neither a
            string nor text parts (``None`` is allowed for an assistant message
            carrying ``tool_calls``).
    """
    if not isinstance(messages, list | tuple) or not messages:
        raise ChatTemplateError("messages must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be an object")
        role = message.get("role")
        if role not in ROLES:
            raise ChatTemplateError(
                f"messages[{i}].role must be one of {sorted(ROLES)}, got {role!r}"
            )
        content = message.get("content")
        if content is None and not (role == "assistant" and message.get("tool_calls")):
            raise ChatTemplateError(f"messages[{i}] has no content")
        out.append({**message, "content": _content_text(i, content)})
    return out


class ChatTemplate:
    """A compiled chat template.

    Args:
        source: The Jinja template text (from GGUF metadata or tokenizer_config.json).
        bos_token: Text of the BOS token, available to the template as ``bos_token``.
        eos_token: Text of the EOS token, available as ``eos_token``.

    Raises:
        ChatTemplateError: The template does not compile.
    """

    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None):
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
        self.source = source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer) -> ChatTemplate:
        """The template a tokenizer ships, with its BOS/EOS tokens.

        Raises:
            ChatTemplateError: The model has no chat template.
        """
        if not tokenizer.chat_template:
            raise ChatTemplateError("this model has no chat template")
        return cls(
            tokenizer.chat_template, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for ``messages``.

        Args:
            messages: OpenAI chat messages (see :func:`normalize_messages`).
            add_generation_prompt: End with the header of an assistant turn.
            tools: OpenAI tool definitions, for templates that render them.
            extra: More template variables (e.g. ``enable_thinking``).

        Raises:
            ChatTemplateError: Bad messages, or the template refused them.
        """
        context = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **extra,
            "messages": normalize_messages(messages),
            "add_generation_prompt": add_generation_prompt,
            "tools": list(tools) if tools else None,
        }
        try:
            return self._template.render(**context)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, KeyError, IndexError) as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
