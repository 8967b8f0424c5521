"""JAX pytree registrations, made once JAX is in use (linattn never imports JAX itself).

* :class:`~linattn.LinearAttentionState` is a pytree: ``kv``, ``log_shift``,
  ``num_tokens`` and the window/sink caches are leaves (``num_tokens`` becomes a 0-d
  integer array under tracing) and the feature map's fingerprint, ``window`` and
  ``sink_keys`` are static data, so a state can be returned from,
  passed into and carried through jitted functions (a ``lax.scan`` decoding loop).
* :class:`~linattn.FeatureMap` is a pytree without leaves whose static data is the map
  itself (hashed by identity): it can be passed to a jitted function as an argument, and
  only another map (a redraw) retraces.

:func:`register` runs as soon as both are imported, in either order (a one-shot import
hook waits for ``import jax`` when linattn comes first).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

__all__ = ["register"]

_registered = False


def register() -> None:
    """Register linattn's types with ``jax.tree_util`` (idempotent)."""
    global _registered
    if _registered:
        return
    from jax import tree_util

    from linattn.features import FeatureMap
    from linattn.state import LinearAttentionState

    def flatten_state(state: LinearAttentionState) -> tuple[tuple[Any, ...], Any]:
        leaves = (state.kv, state.log_shift, state.num_tokens, state.recent, state.sinks)
        return leaves, (state.feature_map, state.window, state.sink_keys)

    def unflatten_state(static: Any, leaves: tuple[Any, ...]) -> LinearAttentionState:
        fingerprint, window, sink_keys = static
        kv, log_shift, num_tokens, recent, sinks = leaves
        return LinearAttentionState(
            kv, log_shift, fingerprint, num_tokens, window, sink_keys, recent, sinks
        )

    tree_util.register_pytree_node(LinearAttentionState, flatten_state, unflatten_state)
    tree_util.register_pytree_node(
        FeatureMap,
        lambda fm: ((), fm),
        lambda fm, _: fm,  # static: the map itself
    )
    _registered = True


def register_when_imported() -> None:
    """Register now if JAX is imported, else right after ``import jax`` (at ``import linattn``)."""
    if "jax" in sys.modules:
        register()
    elif not any(isinstance(finder, _AfterJaxImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterJaxImport())


class _AfterJaxImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``jax`` is loaded, registers, then leaves ``sys.meta_path``.

    Every spec it hands out for ``jax`` gets a loader that registers after loading; a
    spec that is only looked at (``importlib.util.find_spec("jax")``) changes nothing.
    """

    def __init__(self) -> None:
        self._finding = False

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "jax" or self._finding:
            return None
        self._finding = True  # the finders after this one do the finding
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding = False
        loader = None if spec is None else spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        load = loader.exec_module

        def load_then_register(module: Any) -> None:
            load(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            register()

        loader.exec_module = load_then_register  # type: ignore[method-assign]
        return spec
