"""The input guard: checks every prompt before it is scheduled and refuses it (HTTP 400, naming the
rule) when one fires. Built in: regular-expression rules (for example known prompt-injection phrases);
pluggable: any function ``check(text: str) -> str | None`` named as ``module:function``, returning the
name of the rule the text breaks, or None. Off by default.

The engine calls it with the prompt as text (token-id prompts are decoded first), so every route —
OpenAI, KServe over HTTP and gRPC — is covered.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

from inferd.gateway.config import ConfigError, GuardConfig


class InputGuard:
    """The rules and plugins of a :class:`GuardConfig`.

    Raises:
        ConfigError: (at construction) a plugin that cannot be imported or is not callable.
    """

    def __init__(self, config: GuardConfig) -> None:
        self.rules = [(r.name, re.compile(r.pattern, re.IGNORECASE if r.ignore_case else 0)) for r in config.rules]
        self.plugins: list[tuple[str, Callable[[str], str | None]]] = []
        for spec in config.plugins:
            module, _, attr = spec.partition(":")
            try:
                fn = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError, ValueError) as e:
                raise ConfigError(f"input_guard.plugins: cannot import {spec!r}: {e}") from None
            if not callable(fn):
                raise ConfigError(f"input_guard.plugins: {spec!r} is not callable")
            self.plugins.append((spec, fn))

    def check(self, text: str) -> str | None:
        """The name of the first rule ``text`` breaks, or None."""
        for name, rx in self.rules:
            if rx.search(text):
                return name
        for spec, fn in self.plugins:
            rule = fn(text)
            if rule:
                return str(rule)
        return None
