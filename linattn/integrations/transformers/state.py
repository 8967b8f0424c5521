"""What the integration keeps on each attention module: one record, one ``__dict__`` key.

An attention module of a transformers model holds a :class:`LinattnState` under
:data:`KEY` of its ``__dict__`` (not an attribute: a ``torch.nn.Module`` would register
nothing, but ``__dict__`` keeps it out of ``state_dict`` and ``named_modules`` alike).
The record is immutable: :func:`update` replaces it, so a saved record (a conversion's
:class:`linattn.integrations.transformers.convert.SavedState`) never changes under it,
and ``torch.compile`` guards on the fields it reads.  Read it with :func:`state_of`
(which creates nothing: safe inside a trace), write it with :func:`update` and
:func:`clear`, outside the graph (the integration does so through
:func:`linattn._xp.untraced`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from linattn.features import FeatureMap

__all__ = ["EMPTY", "KEY", "LinattnState", "clear", "state_of", "update"]

#: The one ``module.__dict__`` key of the record.
KEY = "_linattn_state"


@dataclass(frozen=True, eq=False)
class LinattnState:
    """One attention module's linattn state (compared by identity: ``eq=False``).

    Attributes
    ----------
    fitted : FeatureMap or None
        The fitted map (``convert``, ``load_fitted``, ``refine``, or the file
        ``config.linattn["fitted"]`` names): used before any drawn map.
    exact_heads : tuple of int
        Query heads attending to every key exactly, beside the fitted hybrid of the
        others (``convert(exact_heads=)``, or a fitted-maps file).
    drawn : FeatureMap or None
        The random map drawn on the module's first call without a fitted map, ...
    drawn_for : tuple or None
        ... and what it was drawn for (head size, scale, causality, ``num_features``,
        ``kind``, ``seed``): another call draws again.
    grouped : FeatureMap or None
        The map in use grouped for grouped-query heads (``FeatureMap.grouped``), ...
    grouped_from : tuple or None
        ... and ``(map, group)`` it was made from (the map by identity).
    calibrated_length : int or None
        The longest input the fitted map was calibrated on, where its file says
        (``max_length``): a longer call warns once that it runs outside that range.

    Examples
    --------
    >>> import torch
    >>> from linattn.integrations.transformers.state import state_of, update
    >>> module = torch.nn.Module()
    >>> state_of(module).exact_heads
    ()
    >>> update(module, exact_heads=(1,)).exact_heads
    (1,)
    """

    fitted: FeatureMap | None = None
    exact_heads: tuple[int, ...] = ()
    drawn: FeatureMap | None = None
    drawn_for: tuple[Any, ...] | None = None
    grouped: FeatureMap | None = None
    grouped_from: tuple[FeatureMap, int] | None = None
    calibrated_length: int | None = None


#: The record of a module that has none (shared: records are immutable).
EMPTY = LinattnState()


def state_of(module: torch.nn.Module) -> LinattnState:
    """``module``'s record, or :data:`EMPTY` (nothing is created or stored)."""
    state: LinattnState = module.__dict__.get(KEY, EMPTY)
    return state


def update(module: torch.nn.Module, **fields: Any) -> LinattnState:
    """Replace ``module``'s record by one with ``fields`` changed; return the new one.

    Raises
    ------
    TypeError
        A name that is not a field of :class:`LinattnState`.
    """
    state = dataclasses.replace(state_of(module), **fields)
    others = (f.name for f in dataclasses.fields(state) if f.name != "exact_heads")
    if not state.exact_heads and all(getattr(state, name) is None for name in others):
        # nothing left: no record (as on a module the integration never touched)
        module.__dict__.pop(KEY, None)
    else:
        module.__dict__[KEY] = state
    return state


def clear(module: torch.nn.Module, saved: LinattnState = EMPTY) -> None:
    """Remove ``module``'s record, or put ``saved`` back in its place."""
    if saved is EMPTY:
        module.__dict__.pop(KEY, None)
    else:
        module.__dict__[KEY] = saved
