"""Run code right after a module is imported, without importing it ourselves: a loader that wraps the
module's real one (used by the zero-code launcher for ``torch``, by ``compile_watch`` for
``torch._dynamo`` and by ``pipeline_watch`` for ``torch.distributed.pipelining``)."""

from __future__ import annotations

import importlib.abc
from collections.abc import Callable
from typing import Any

__all__ = ["CallbackLoader"]


class CallbackLoader(importlib.abc.Loader):
    """The module's own loader, plus ``after()`` once the module has executed. The module keeps its
    real loader (``__loader__`` and ``__spec__.loader``); ``after`` must not raise (callers wrap it)."""

    def __init__(self, inner: Any, after: Callable[[], None]) -> None:
        self._inner = inner
        self._after = after

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        try:
            module.__loader__ = self._inner
            if module.__spec__ is not None:
                module.__spec__.loader = self._inner
        except Exception:  # noqa: BLE001
            pass
        self._inner.exec_module(module)
        self._after()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
