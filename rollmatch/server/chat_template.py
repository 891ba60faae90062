"""The served model's chat template, rendered in a sandbox with a bounded amount of work.

Owns: :class:`ChatTemplate`, the tokenizer's own template compiled once in a Jinja sandbox set up
as transformers' ``apply_chat_template`` sets it up (``trim_blocks`` / ``lstrip_blocks``,
``loopcontrols``, the ``generation`` tag, ``raise_exception``, ``tojson``, ``strftime_now``, the
special tokens as variables), so the text equals ``tokenizer.apply_chat_template(messages,
tokenize=False, add_generation_prompt=True, **flags)``; and the two ways a render fails on a
request: :class:`TemplateRefused` (a 400 carrying the template's own message, e.g. Qwen3's "No
user query found in messages.") and :class:`RenderOverBudget` (a 422).

Bounded work: every iteration of every ``for`` loop and every call the template makes (macros,
methods, ``loop()`` recursion) spends one step of a budget of :data:`RENDER_STEPS` per render.
Loops and calls are the only ways a Jinja template repeats work, so whatever the conversation,
a render stops after that many steps, each doing the straight-line work of the template's own text
on values the conversation's size caps bound. A step budget rather than a clock: it ends the render from inside (a Python
thread cannot be killed), and a loaded server never refuses a request a quiet one would serve.
Leaves out: which flags a request may pass (``protocol.TEMPLATE_FLAGS``, checked at the wire),
the conversation's size caps (messages and parts at the wire, text in ``server.prompt_preparer``) and
tokenization.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from datetime import datetime
from typing import Any, ClassVar

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rollmatch.server.limits import RequestTooLarge

# The largest conversation the wire admits (256 messages x 256 parts) takes ~66k steps (0.3 s) on a
# Qwen-style template: room for templates a few times as busy; past it, a render stops within ~1 s.
RENDER_STEPS = 1_000_000
_COUNTED = "rollmatch_counted_loop"  # the filter wrapped around every loop's iterable
# What a render can raise on a conversation it cannot handle (raise_exception, an undefined
# value, a sandbox refusal, "str" + list, a division by zero, runaway recursion, ...).
_RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, LookupError, ArithmeticError, RecursionError)


class TemplateRefused(ValueError):
    """The chat template refused the conversation (a 400 with the template's message)."""


class RenderOverBudget(RequestTooLarge):
    """The render ran out of steps (a 422): the conversation is too large for the template."""

    def __init__(self, where: str, steps: int):
        super().__init__(
            where,
            f"{where}: rendering the chat template took more than {steps} loop iterations and calls; send a "
            "shorter conversation",
            status=422,
        )


class _Budget:
    __slots__ = ("left", "steps", "where")

    def __init__(self, steps: int, where: str):
        self.left = self.steps = steps
        self.where = where

    def spend(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise RenderOverBudget(self.where, self.steps)


_BUDGET: ContextVar[_Budget] = ContextVar("rollmatch_render_budget")


class ChatTemplate:
    """A tokenizer's chat template, compiled once; :meth:`render` is safe to call from many threads."""

    def __init__(self, source: str, special_tokens: Mapping[str, Any], *, steps: int = RENDER_STEPS):
        self.source, self.steps = source, steps
        self.special_tokens = dict(special_tokens)
        environment = _BoundedSandbox()
        tree = environment.parse(source)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Filter(loop.iter, _COUNTED, [], [], None, None, lineno=loop.lineno)
        self._template = environment.from_string(tree)

    @classmethod
    def of_tokenizer(cls, tokenizer: Any, *, steps: int = RENDER_STEPS) -> ChatTemplate | None:
        """The tokenizer's (default) template; ``None`` when it has none."""
        try:
            source = tokenizer.get_chat_template()
        except ValueError:  # transformers: "Cannot use chat template functions because ... not set"
            return None
        return cls(source, tokenizer.special_tokens_map, steps=steps)

    def render(
        self, messages: list[dict[str, Any]], flags: Mapping[str, Any], where: str = "messages"
    ) -> str:
        """The prompt text with the generation prompt appended; ``flags`` are the template variables
        a request set (see ``protocol.TEMPLATE_FLAGS``).

        Raises :class:`TemplateRefused` with the template's message, or :class:`RenderOverBudget`;
        both name ``where`` (the request's field).
        """
        context = {
            **self.special_tokens,
            "messages": messages,
            "tools": None,
            "documents": None,
            "add_generation_prompt": True,
            **flags,
        }
        token = _BUDGET.set(_Budget(self.steps, where))
        try:
            return self._template.render(context)
        except RenderOverBudget:
            raise
        except _RENDER_ERRORS as exc:
            raise TemplateRefused(
                f"{where}: the served model's chat template cannot render these messages: "
                f"{type(exc).__name__}: {str(exc)[:500]}"
            ) from exc
        finally:
            _BUDGET.reset(token)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' chat-template sandbox, with every call spending a step of the render's budget
    (loop iterations spend theirs through the :data:`_COUNTED` filter)."""

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
        self.filters["tojson"] = _tojson
        self.filters[_COUNTED] = _counted
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        _BUDGET.get().spend()
        return super().call(context, obj, *args, **kwargs)


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}``: transformers' marker of assistant tokens; renders
    its body unchanged, in its own scope (as transformers' call block does)."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _counted(iterable: Iterable[Any]) -> Iterator[Any]:
    budget = _BUDGET.get()
    for item in iterable:
        budget.spend()
        yield item


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson`` (no HTML escaping, ``indent`` / ``separators`` / ``sort_keys``)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)
