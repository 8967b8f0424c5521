"""The options of ``attn_implementation="linattn"``: those of
:func:`~linattn.integrations.transformers.register`, checked, and
each model's ``config.linattn`` over them; and switching a model to the implementation.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from transformers import AttentionInterface

from linattn.features import KINDS
from linattn.hybrid.build import check_exact_parts

__all__ = ["DEFAULTS", "NAME", "check_options", "options_for", "set_options", "use_linattn"]

NAME = "linattn"
#: The options and their defaults; ``register`` sets them for every model, a model's
#: ``config.linattn`` (a dict) overrides them per model.
DEFAULTS: dict[str, Any] = {
    "num_features": 256,
    "kind": None,
    "seed": 0,
    "window": None,
    "sink_keys": 0,
    "exact_keys": None,
}
_options: dict[str, Any] = dict(DEFAULTS)

ExactKeys = Callable[[torch.Tensor], torch.Tensor]
#: A transformers ``PreTrainedModel`` (its ``config`` and methods are untyped here).
Model = Any


def set_options(**options: Any) -> None:
    """:func:`linattn.integrations.transformers.register`'s options: every option set,
    those not given to their defaults, checked (errors name ``register``)."""
    checked = check_options({**DEFAULTS, **options}, "register", given=options)
    _options.clear()
    _options.update(checked)


def check_options(
    settings: Mapping[str, Any], where: str, *, given: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """``settings`` (every option), checked; errors name ``where`` they came from.

    Parameters
    ----------
    settings : mapping
        Every option of :data:`DEFAULTS`, with its value.
    where : str
        ``"register"`` or ``"config.linattn"``, for the messages.
    given : mapping, optional
        The options the user gave (default ``settings``): only their names are checked
        against the known ones.

    Returns
    -------
    dict
        ``settings`` as a new dict.

    Raises
    ------
    TypeError
        An unknown option, or ``exact_keys`` neither None, ``"special"``, ``"sep"`` nor
        callable.
    ValueError
        ``num_features`` neither a positive integer nor None; ``num_features=None``
        without ``window``, ``sink_keys`` or ``exact_keys`` (nothing left to attend), or
        with ``kind``; an unknown ``kind``; ``window`` or ``sink_keys`` that
        ``linattn.linear_attention`` refuses.

    Examples
    --------
    >>> from linattn.integrations.transformers import DEFAULTS, check_options
    >>> check_options({**DEFAULTS, "num_features": None}, "register")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: register: num_features=None (no feature map) needs window, sink_keys or ...
    >>> check_options({**DEFAULTS, "num_features": None, "window": 64}, "register")["window"]
    64
    """
    unknown = set(settings if given is None else given) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"{where} takes {', '.join(DEFAULTS)}; got {sorted(unknown)}")
    settings = dict(settings)
    features, kind, exact_keys = settings["num_features"], settings["kind"], settings["exact_keys"]
    if features is not None and (
        isinstance(features, bool) or not isinstance(features, int | np.integer) or features < 1
    ):
        raise ValueError(
            f"{where}: num_features must be a positive integer, or None for no feature map "
            f"(exact window, sinks and exact keys only); got {features!r}"
        )
    if kind is not None and kind not in KINDS:
        raise ValueError(f"{where}: kind must be None or one of {sorted(KINDS)}; got {kind!r}")
    if not (exact_keys is None or exact_keys in ("special", "sep") or callable(exact_keys)):
        raise TypeError(
            f"{where}: exact_keys must be None, 'special' (each row's first and last real "
            f"token: [CLS] and [SEP]), 'sep' (the last: [SEP]) or a callable (B, L_k) key "
            f"mask -> (B, L_k) boolean tensor; got {exact_keys!r}"
        )
    try:  # the front door's own check of the hybrid's options, on no keys
        check_exact_parts(
            settings["window"], settings["sink_keys"], None, xp=np, causal=False,
            state=None, query_length=0, key_length=0, k=np.empty((0, 1)),
        )  # fmt: skip
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    if features is None:
        if settings["window"] is None and not settings["sink_keys"] and exact_keys is None:
            raise ValueError(
                f"{where}: num_features=None (no feature map) needs window, sink_keys or "
                "exact_keys (the keys attended exactly); got none of them"
            )
        if kind is not None:
            raise ValueError(
                f"{where}: kind={kind!r} is a feature map's, and num_features=None asks for "
                "none; give num_features, or leave kind out"
            )
    return settings


def options_for(module: torch.nn.Module) -> dict[str, Any]:
    """The options for ``module``'s model: those of
    :func:`linattn.integrations.transformers.register`, then ``config.linattn``'s."""
    config = getattr(module, "config", None)
    overrides = dict(getattr(config, "linattn", None) or {})
    if not overrides:
        return _options
    path = overrides.pop("fitted", None)  # the fitted maps' file (see save_fitted)
    if path is not None and not isinstance(path, str | os.PathLike):
        raise TypeError(
            f"config.linattn: fitted must be the path of a fitted-maps file; got {path!r}"
        )
    settings = check_options({**_options, **overrides}, "config.linattn", given=overrides)
    settings["fitted"] = path
    return settings


def use_linattn(model: Model) -> None:
    """Switch ``model`` to ``attn_implementation="linattn"`` (registered on import)."""
    if NAME not in AttentionInterface._global_mapping:
        raise RuntimeError(
            "attn_implementation='linattn' is not registered: import "
            "linattn.integrations.transformers (or call its register())"
        )
    if model.config._attn_implementation != NAME:
        model.set_attn_implementation(NAME)
