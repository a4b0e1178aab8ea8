"""The one configuration error of both halves: the plugin's settings and the adapter's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A setting that cannot be run with; each problem names the key and the fix.

    ``problems``: one message, or every problem one check found (kept in ``problems``);
    ``context`` heads the message when given.
    """

    def __init__(self, problems: Union[str, Sequence[str]], context: str = "") -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        text = "; ".join(self.problems)
        super().__init__(f"{context}: {text}" if context else text)
