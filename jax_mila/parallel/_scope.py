"""The value a parallel scheme is active with while a step is traced inside shard_map (its mesh
axis; None outside). The model's layers read it to decide how to split or merge their work."""

from __future__ import annotations

import contextlib
import contextvars


class TraceScope:
    def __init__(self, name: str):
        self._var = contextvars.ContextVar(name, default=None)

    @contextlib.contextmanager
    def bound(self, value):
        """``value`` is what ``get`` returns inside this context, and None again after it."""
        token = self._var.set(value)
        try:
            yield
        finally:
            self._var.reset(token)

    def get(self):
        return self._var.get()
