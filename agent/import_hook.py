"""Run code right after a module is imported, without importing it ourselves: a loader that wraps the
module's real one (used by the zero-code launcher for ``torch``, by ``compile_watch`` for
``torch._dynamo`` and by ``pipeline_watch`` for ``torch.distributed.pipelining``), and ``AfterImport``, the
meta-path finder that installs it for named modules (checkpoints, torchrun's agent, HF / Lightning)."""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["CallbackLoader", "AfterImport"]


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


class AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when one of ``callbacks``' modules is looked for, it takes the real spec
    from the finders after it and wraps its loader so that the module's callback runs right after
    the module has executed. Each name fires once; the finder leaves ``sys.meta_path`` when none is
    left. Install it with ``sys.meta_path.insert(0, AfterImport({...}))``."""

    def __init__(self, callbacks: dict[str, Callable[[], None]]) -> None:
        self._callbacks = dict(callbacks)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        after = self._callbacks.pop(fullname, None)
        if after is None:
            return None
        if not self._callbacks:
            try:
                sys.meta_path.remove(self)
            except ValueError:
                pass
        spec = None
        try:
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        except Exception:  # noqa: BLE001 - the normal import machinery takes over
            return None
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = CallbackLoader(spec.loader, after)
        return spec
