"""How overnight's processes log: one format, set up once by the command line and again in every
process it spawns.

A spawned process (the server's engine process, tensor parallel ranks, data parallel engines) starts
with no logging set up, so its warnings and INFO lines (the start-up's parts, a Triton compile in the
middle of a run) went nowhere. The parent captures its setup when it starts one (LogSetup.capture),
the child applies it first thing; both write to their own stderr, which the child inherits.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format=FORMAT, stream=sys.stderr)


@dataclass(frozen=True)
class LogSetup:
    """The parent's root logging level, or None where the parent set up no logging (a library user
    who configures nothing gets nothing from the children either)."""

    level: int | None

    @classmethod
    def capture(cls) -> LogSetup:
        root = logging.getLogger()
        return cls(root.level if root.handlers else None)

    def apply(self) -> None:
        if self.level is not None and not logging.getLogger().handlers:
            configure(self.level)
