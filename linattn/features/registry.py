"""The live-map registry: weak references to every live map by fingerprint, and its lock.

Custom operators take tensors and scalars only: a torch operator that needs a feature
map is passed its fingerprint and finds the map through
:func:`linattn.features.feature_map_for`, which asks the registry that
:class:`linattn.FeatureMap` fills as each map is made (outside any traced code).  The
registry knows only fingerprints, so that it sits below the class that uses it.
"""

from __future__ import annotations

import threading
import weakref
from typing import Generic, Protocol, TypeVar

__all__ = ["Fingerprinted", "LiveRegistry"]


class Fingerprinted(Protocol):
    """What the registry reads of an object (a :class:`linattn.FeatureMap` is one)."""

    @property
    def fingerprint(self) -> str: ...


T = TypeVar("T", bound=Fingerprinted)


class LiveRegistry(Generic[T]):
    """Every live object by fingerprint: weak references to all the equal ones alive, so
    that one's death leaves the others found.

    Examples
    --------
    >>> import linattn as la
    >>> from linattn.features.registry import LiveRegistry
    >>> live = LiveRegistry[la.FeatureMap]()
    >>> fm = la.FeatureMap(4, 8)
    >>> live.register(fm)
    >>> live.find(fm.fingerprint) is fm, live.find("none")
    (True, None)
    """

    __slots__ = ("_live", "_lock")

    def __init__(self) -> None:
        self._live: dict[str, list[weakref.ref[T]]] = {}
        # Guards ``_live``; re-entrant, since a reference's callback may run (garbage
        # collection) in a thread that holds it.
        self._lock = threading.RLock()

    def register(self, obj: T) -> None:
        """Remember ``obj`` (weakly) under its fingerprint until it dies."""
        fingerprint = obj.fingerprint

        def forget(ref: weakref.ref[T]) -> None:
            with self._lock:
                refs = [r for r in self._live.get(fingerprint, []) if r is not ref]
                if refs:
                    self._live[fingerprint] = refs
                else:
                    self._live.pop(fingerprint, None)

        with self._lock:
            self._live[fingerprint] = [*self._live.get(fingerprint, []), weakref.ref(obj, forget)]

    def find(self, fingerprint: str) -> T | None:
        """A live object with ``fingerprint`` (any of equal ones), or ``None``."""
        with self._lock:
            refs = list(self._live.get(fingerprint, []))
        for ref in refs:
            if (obj := ref()) is not None:
                return obj
        return None
