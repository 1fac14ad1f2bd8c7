"""The one exception the trace importer raises."""

from __future__ import annotations

__all__ = ["TraceError"]


class TraceError(ValueError):
    """A trace file cannot be read or reduced; the message starts with the file's name and says what is wrong."""

    def __init__(self, source: str, problem: str) -> None:
        super().__init__(f"{source}: {problem}")
        self.source = source
        self.problem = problem
