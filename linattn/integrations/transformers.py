"""Hugging Face transformers: ``attn_implementation="linattn"`` and a decoding cache.

:func:`register` adds :func:`attention_forward` to transformers' ``AttentionInterface``.
It borrows SDPA's mask function, so the attention receives a boolean 4-D mask (or None
for a plain causal one), accepted when it is padding, optionally causal, only.  Every
option of :func:`linattn.linear_attention` is reachable: random features, no feature map
(``num_features=None``: exact window and sinks), the window/sink hybrid, and exact keys
derived per row from the mask (``exact_keys="special"``: ``[CLS]`` and ``[SEP]``).
:class:`LinearAttentionCache` holds one
:class:`linattn.LinearAttentionState` per layer and passes only the new tokens on.
:func:`convert` fits a model's attention (fitted feature maps, weights frozen);
:func:`refine` fits the converted layers' maps together, end to end
(:mod:`linattn.integrations.transformers_refine`); :func:`save_fitted` and
:func:`load_fitted` keep the maps in a file, :func:`layer_errors` measures them
(:mod:`linattn.integrations.transformers_convert`).  Importing this module makes
``attn_implementation="linattn"`` available with the default options.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from linattn._gqa import grouped
from linattn._xp import namespace_of, require, untraced
from linattn.attention import linear_attention
from linattn.features import KINDS, SOFTMAX_KINDS, FeatureMap
from linattn.hybrid.build import check_exact_parts
from linattn.integrations.transformers_convert import (
    EXACT_HEADS,
    FITTED,
    AttentionCall,
    capture_hook,
    convert,
    layer_errors,
    load_fitted,
    map_from_file,
    save_fitted,
    splice_exact_heads,
)
from linattn.integrations.transformers_refine import refine
from linattn.state import LinearAttentionState

__all__ = [
    "DEFAULTS",
    "NAME",
    "LinearAttentionCache",
    "attention_forward",
    "check_options",
    "convert",
    "layer_errors",
    "load_fitted",
    "refine",
    "register",
    "save_fitted",
    "special_keys",
]

NAME = "linattn"
#: The options and their defaults; :func:`register` sets them for every model, a model's
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
#: The cache layer the current thread's attention call belongs to (set by its update).
_active = threading.local()

ExactKeys = Callable[[torch.Tensor], torch.Tensor]


def register(**options: Any) -> None:
    """Make ``attn_implementation="linattn"`` available to every transformers model.

    Each call sets every option: those not given return to their defaults.

    Parameters
    ----------
    **options
        ``num_features`` (256): random features per head, or ``None`` for no feature
        map (exact attention to the window, the sinks and the exact keys only: keys
        beyond them are dropped, not estimated).  ``kind`` (``"hyperbolic"`` for
        decoders, ``"hyperbolic_oprf"`` with per-call statistics for encoders), ``seed``
        (0; layer ``l`` draws with ``seed + l``).  ``window`` (None) and ``sink_keys``
        (0): the window/sink hybrid (``linattn.linear_attention``).  ``exact_keys``
        (None): keys every query attends exactly, bidirectional models only:
        ``"special"`` for each row's first and last real token (``[CLS]`` and ``[SEP]``
        in BERT models, found from the attention mask), or a callable taking the
        ``(B, L_k)`` boolean key mask (True for real tokens; all True without padding)
        and returning a ``(B, L_k)`` boolean tensor (True for the exact keys).  A
        model's ``config.linattn = {...}`` overrides them per model.

    Raises
    ------
    TypeError
        An unknown option.
    ValueError
        An option's value (see :func:`check_options`).

    Examples
    --------
    >>> from linattn.integrations.transformers import register
    >>> register(num_features=128)
    >>> from transformers import AttentionInterface
    >>> "linattn" in AttentionInterface._global_mapping
    True

    The default ``docs/estimators.md`` supports for all-MiniLM-L6-v2: exact attention to
    a window of 64, position 0 as a sink and ``[CLS]`` / ``[SEP]``, no feature map:

    >>> register(num_features=None, window=64, sink_keys=1, exact_keys="special")
    """
    settings = check_options({**DEFAULTS, **options}, "register", given=options)
    _options.clear()
    _options.update(settings)
    _register()


def _register() -> None:
    AttentionInterface.register(NAME, attention_forward)
    # Without a mask function of its own an implementation gets no mask at all; SDPA's
    # boolean 4-D masks (None where causality alone says it all) are converted below.
    AttentionMaskInterface.register(NAME, sdpa_mask)


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
        An unknown option, or ``exact_keys`` neither None, ``"special"`` nor callable.
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
    if not (exact_keys is None or exact_keys == "special" or callable(exact_keys)):
        raise TypeError(
            f"{where}: exact_keys must be None, 'special' (each row's first and last real "
            f"token: [CLS] and [SEP]) or a callable (B, L_k) key mask -> (B, L_k) boolean "
            f"tensor; got {exact_keys!r}"
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


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``(B, H, L, d)`` in, ``(B, L, H, d)`` out."""
    if dropout > 0:
        raise ValueError(
            f"attention dropout must be 0 with attn_implementation='linattn' (no attention "
            f"weights exist to drop); got dropout={dropout} (set the config's attention "
            "dropout to 0, or call model.eval())"
        )
    if kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        raise ValueError("linattn cannot apply position biases or softcapping; got one")
    settings = _settings(module)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))
    layer = getattr(_active, "layer", None)
    _active.layer = None
    if layer is None and causal and key.shape[-2] > query.shape[-2]:
        raise ValueError(
            "past_key_values must be a linattn.integrations.transformers.LinearAttentionCache "
            "with attn_implementation='linattn'; got another transformers cache (keys "
            f"{key.shape[-2]} long for {query.shape[-2]} queries: e.g. generate's default "
            "DynamicCache)"
        )
    if layer is not None and attention_mask is not None:
        # The mask covers the cached keys too; the state already holds them, masked.
        attention_mask = attention_mask[..., -key.shape[-2] :]
    key_mask, mask_causal = key_mask_from(
        attention_mask, query.shape[-2], key.shape[-2], causal=causal or layer is not None
    )
    causal = causal or mask_causal or layer is not None
    exact_key_mask = _exact_keys(settings, key_mask, key, causal, module)
    capture = capture_hook()  # inside convert: exact attention, or a layer's capture
    if capture is not None:
        call = AttentionCall(
            module, query, key, value, attention_mask, scaling, is_causal, kwargs,
            key_mask, exact_key_mask, causal,
        )  # fmt: skip
        captured = capture(call)
        if captured is not None:
            return captured, None
    feature_map = _feature_map(module, settings, query.shape[-1], scaling, causal)
    q, k, v, grouped_mask, ungroup = grouped(query, key, value, key_mask)
    if feature_map is not None and q.ndim > query.ndim:  # per-head parameters: grouped too
        feature_map = _grouped_map(module, feature_map, int(q.shape[-3]))
    if exact_key_mask is not None:  # shaped like the key mask, grouped alike
        exact_key_mask = grouped(query, key, value, exact_key_mask)[3]
    options: dict[str, Any] = {
        "window": settings["window"],
        "sink_keys": settings["sink_keys"],
        "exact_key_mask": exact_key_mask,
        "scale": scaling if feature_map is None else None,
    }
    with torch.autocast(query.device.type, enabled=False):
        if layer is not None:
            out, layer.state = linear_attention(
                q, k, v, feature_map, causal=True, key_mask=grouped_mask, state=layer.state,
                return_state=True, **options,
            )  # fmt: skip
        else:
            out = linear_attention(
                q, k, v, feature_map, causal=causal, key_mask=grouped_mask, **options
            )
        out = ungroup(out)
        heads = module.__dict__.get(EXACT_HEADS)
        if layer is not None and heads:
            out = layer.exact_heads(out, query, key, value, key_mask, scaling, heads)
        else:
            out = splice_exact_heads(module, out, query, key, value, key_mask, causal, scaling)
    return out.transpose(1, 2).contiguous(), None


def special_keys(key_mask: torch.Tensor) -> torch.Tensor:
    """Each row's first and last real token (``[CLS]`` and ``[SEP]`` in BERT models).

    Parameters
    ----------
    key_mask : boolean tensor, shape ``(..., L_k)``
        True for real tokens; padding may be on either side.

    Returns
    -------
    boolean tensor, shape ``(..., L_k)``
        True at the first and the last True of each row (none in a row without one).

    Examples
    --------
    >>> import torch
    >>> from linattn.integrations.transformers import special_keys
    >>> special_keys(torch.tensor([[1, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)).int()
    tensor([[1, 0, 0, 1],
            [0, 1, 1, 0]], dtype=torch.int32)
    """
    length = key_mask.shape[-1]
    positions = torch.arange(length, device=key_mask.device)
    first = torch.where(key_mask, positions, length).amin(dim=-1, keepdim=True)
    last = torch.where(key_mask, positions, -1).amax(dim=-1, keepdim=True)
    return ((positions == first) | (positions == last)) & key_mask


_BIASES = (
    "attention_mask must hold only 0 and -inf (or the dtype's minimum): linattn cannot add "
    "attention biases (ALiBi, T5 relative positions); got other values"
)
_PATTERN = (
    "attention_mask must be a padding mask, optionally causal: linattn cannot apply other "
    "4-D masks (sliding windows, block patterns, packed sequences); got one"
)


def key_mask_from(
    attention_mask: torch.Tensor | None,
    query_length: int,
    key_length: int,
    *,
    causal: bool | None = None,
) -> tuple[torch.Tensor | None, bool]:
    """``(key_mask (B, 1, L_k) True = keep, causal)`` from the mask transformers passes.

    2-D ``(B, L)`` masks are padding masks (1 keep, 0 padding; with a cache, the last
    ``L_k`` columns are the new keys').  4-D ``(B, 1, L_q, L_k)`` masks, boolean (True
    keep) or additive (0 keep, ``-inf`` or the dtype's minimum masked), must be padding
    and optionally causal; anything else (ALiBi or T5 biases, other patterns) raises.

    Under ``torch.compile`` with ``causal`` (the module's own flag) given, the mask's
    values are not read while tracing (each read would split the graph): the mask is
    asserted on its device, when the graph runs (``torch._assert_async``: a
    ``RuntimeError`` with the same message), to be padding, causal exactly when
    ``causal`` is.
    """
    if attention_mask is None:
        return None, False
    if attention_mask.ndim == 2:
        return attention_mask[:, None, -key_length:].to(torch.bool), False
    if attention_mask.ndim != 4:
        raise ValueError(
            f"attention_mask must be 2-D (B, L) or 4-D (B, 1, L_q, L_k); got shape "
            f"{tuple(attention_mask.shape)}"
        )
    traced = causal is not None and torch.compiler.is_compiling()
    xp = namespace_of({"attention_mask": attention_mask})
    if attention_mask.dtype == torch.bool:
        keep = attention_mask
    else:
        lowest = torch.finfo(attention_mask.dtype).min
        masked = (attention_mask == lowest) | torch.isneginf(attention_mask)
        require(xp, ~((attention_mask != 0) & ~masked).any(), _BIASES)
        keep = ~masked
    if keep.shape[1] != 1 or keep.shape[-2:] != (query_length, key_length):
        raise ValueError(
            f"attention_mask must have shape (B, 1, {query_length}, {key_length}); got "
            f"{tuple(keep.shape)}"
        )
    padding = keep.any(dim=-2)  # (B, 1, L_k): keys some query sees
    below = torch.ones(query_length, key_length, dtype=torch.bool, device=keep.device)
    below = below.tril(key_length - query_length)
    rows = keep.any(dim=-1, keepdim=True)  # queries that see nothing may hold anything

    def matches(causal: bool) -> torch.Tensor:
        pattern = padding[:, :, None, :] & (below if causal else True)
        return ((keep & rows) == (pattern & rows)).all()

    if traced:  # (require asserts: the pattern is the module's)
        module_rule = f" (under torch.compile: causal exactly when the module is, {causal=})"
        require(xp, matches(bool(causal)), _PATTERN + module_rule)
        return padding, bool(causal)
    for pattern_causal in (False, True):
        if bool(matches(pattern_causal)):
            return padding, pattern_causal
    raise ValueError(_PATTERN)


class _ExactKeys(NamedTuple):
    """The keys and values so far of the key heads that a layer's exact heads read."""

    key_heads: tuple[int, ...]  # key heads kept, ascending
    keys: torch.Tensor  # (B, len(key_heads), L, d)
    values: torch.Tensor  # (B, len(key_heads), L, d_v)
    key_mask: torch.Tensor  # (B, L) True = a real key


class _StateLayer(DynamicLayer):
    """One layer of :class:`LinearAttentionCache`: a state, the count of tokens, and for
    a layer with exact heads the keys and values those heads read."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.state: LinearAttentionState | None = None
        self.seen = 0
        self.exact: _ExactKeys | None = None

    def exact_heads(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_mask: torch.Tensor | None,
        scaling: float | None,
        heads: tuple[int, ...],
    ) -> torch.Tensor:
        """``out`` ``(B, H, L_q, d_v)`` with ``heads`` attending exactly, causally, to
        every real key so far: the new ``key``/``value`` (``(B, H_kv, L_q, .)``) join
        the kept ones of the key heads they read (query head ``h`` reads key head ``h //
        (H / H_kv)``), a KV cache of those heads only; a row without keys gets zeros."""
        group = query.shape[-3] // key.shape[-3]
        key_heads = tuple(sorted({h // group for h in heads}))
        batch, length = key.shape[0], key.shape[-2]
        mask = (
            torch.ones(batch, length, dtype=torch.bool, device=key.device)
            if key_mask is None
            else key_mask.expand(batch, 1, length)[:, 0]
        )
        new = _ExactKeys(key_heads, key[:, key_heads], value[:, key_heads], mask)
        if self.exact is not None:
            if self.exact.key_heads != key_heads:
                raise ValueError(
                    f"this cache layer kept key heads {self.exact.key_heads} for exact heads; "
                    f"got a call whose exact heads read {key_heads} (one cache per model)"
                )
            new = _ExactKeys(
                key_heads,
                torch.cat([self.exact.keys, new.keys], dim=-2),
                torch.cat([self.exact.values, new.values], dim=-2),
                torch.cat([self.exact.key_mask, mask], dim=-1),
            )
        self.exact = new
        dtype = torch.promote_types(query.dtype, torch.float32)
        rows = [key_heads.index(h // group) for h in heads]
        q = query[:, list(heads)].to(dtype)
        k, v = new.keys[:, rows].to(dtype), new.values[:, rows].to(dtype)
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        total, count = k.shape[-2], q.shape[-2]
        below = torch.ones(count, total, dtype=torch.bool, device=q.device).tril(total - count)
        allowed = new.key_mask[:, None, None, :] & below  # (B, 1, L_q, L_k)
        logits = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, -math.inf)
        weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # rows without keys: 0
        spliced = out.clone()
        spliced[:, list(heads)] = (weights @ v).to(out.dtype)
        return spliced

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += int(key_states.shape[-2])
        _active.layer = self  # the attention call that follows continues this state
        return key_states, value_states  # only the new tokens

    def get_seq_length(self) -> int:
        return self.seen

    def reset(self) -> None:
        self.state, self.seen, self.exact = None, 0, None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("LinearAttentionCache does not support beam search")


class LinearAttentionCache(Cache):
    """A transformers cache of one :class:`linattn.LinearAttentionState` per layer.

    Memory is ``num_features x (d + 1)`` per head and layer, whatever the length; each
    step's attention sees only the new tokens and continues the state.  A layer with
    exact heads (``convert(..., exact_heads=)``) also keeps the keys and values of the
    key heads those read, which grow with the length: they attend to every real key so
    far, as without the cache.

    Examples
    --------
    >>> from linattn.integrations.transformers import LinearAttentionCache
    >>> cache = LinearAttentionCache()
    >>> cache.get_seq_length()
    0
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(layer_class_to_replicate=_StateLayer)


def _settings(module: torch.nn.Module) -> dict[str, Any]:
    """The options for ``module``'s model: :func:`register`'s, then ``config.linattn``'s."""
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


def _exact_keys(
    settings: dict[str, Any],
    key_mask: torch.Tensor | None,
    key: torch.Tensor,
    causal: bool,
    module: torch.nn.Module,
) -> torch.Tensor | None:
    """The ``exact_key_mask`` the ``exact_keys`` option asks for, shaped like ``key_mask``."""
    rule = settings["exact_keys"]
    if rule is None:
        return None
    if causal:
        raise ValueError(
            f"exact_keys={rule!r} is for bidirectional attention (encoders such as BERT): "
            "a causal query's exact keys are its window and the sinks (use sink_keys); got "
            f"a causal call in {type(module).__name__}"
        )
    batch, length = int(key.shape[0]), int(key.shape[-2])
    mask = (
        torch.ones(batch, length, dtype=torch.bool, device=key.device)
        if key_mask is None
        else key_mask.expand(batch, 1, length)[:, 0]
    )
    if rule == "special":
        return special_keys(mask)[:, None]
    exact = rule(mask)
    if (
        not isinstance(exact, torch.Tensor)
        or exact.dtype != torch.bool
        or tuple(exact.shape) != (batch, length)
    ):
        got = (
            f"dtype {exact.dtype}, shape {tuple(exact.shape)}"
            if isinstance(exact, torch.Tensor)
            else type(exact).__name__
        )
        raise ValueError(
            f"exact_keys (a callable) must return a boolean tensor of shape ({batch}, "
            f"{length}) (B, L_k); got {got}"
        )
    return (exact & mask)[:, None]


def _feature_map(
    module: torch.nn.Module,
    settings: dict[str, Any],
    head_dim: int,
    scaling: float | None,
    causal: bool,
) -> FeatureMap | None:
    """One map per layer, kept on the module (the same projection every call).

    A fitted map (:func:`convert`, :func:`load_fitted`, or the file
    ``config.linattn["fitted"]`` names, read on the module's first call) comes first.
    A map is read or drawn on the module's first call only, outside ``torch.compile``'s
    graph (a model compiled before any eager call keeps a graph break there).
    """
    fitted: FeatureMap | None = module.__dict__.get(FITTED)
    if fitted is None and settings.get("fitted") is not None:
        untraced(map_from_file, module, settings["fitted"], settings)  # keeps it on module
        fitted = module.__dict__[FITTED]  # (read back: a value torch.compile can guard)
    if fitted is not None:
        expected = head_dim**-0.5 if scaling is None else scaling
        if fitted.head_dim != head_dim or not math.isclose(fitted.scale, expected, rel_tol=1e-6):
            raise ValueError(
                f"the fitted map of {type(module).__name__} was fitted for head_dim "
                f"{fitted.head_dim} and scale {fitted.scale}; this call has head_dim "
                f"{head_dim} and scale {expected}"
            )
        return fitted
    if settings["num_features"] is None:
        return None
    key = (
        head_dim, scaling, causal,
        tuple(settings[name] for name in ("num_features", "kind", "seed")),
    )  # fmt: skip
    cached = module.__dict__.get("_linattn_feature_map")
    if cached is not None and cached[0] == key:
        kept: FeatureMap = cached[1]
        return kept
    untraced(_draw, module, key, settings, head_dim, scaling, causal)
    drawn: FeatureMap = module.__dict__["_linattn_feature_map"][1]  # (read back, as above)
    return drawn


def _draw(
    module: torch.nn.Module,
    key: tuple[Any, ...],
    settings: dict[str, Any],
    head_dim: int,
    scaling: float | None,
    causal: bool,
) -> FeatureMap:
    """The module's random map, drawn and kept on it under ``key``."""
    kind = settings["kind"] or ("hyperbolic" if causal else "hyperbolic_oprf")
    feature_map = FeatureMap(
        head_dim,
        settings["num_features"],
        kind=kind,  # type: ignore[arg-type]
        scale=scaling,
        seed=settings["seed"] + _layer_index(module),  # each layer its own draw
        rebalance=not causal and kind in SOFTMAX_KINDS,  # per-call statistics: encoders only
    )
    module.__dict__["_linattn_feature_map"] = (key, feature_map)
    return feature_map


#: Where an attention module keeps its map grouped for grouped-query heads.
GROUPED = "_linattn_grouped_map"


def _grouped_map(module: torch.nn.Module, feature_map: FeatureMap, group: int) -> FeatureMap:
    """``feature_map.grouped(group)`` (grouped-query heads), kept on the module: the
    host arrays are made on the module's first call only, outside ``torch.compile``'s
    graph (a model compiled before any eager call keeps a graph break there)."""
    cached = module.__dict__.get(GROUPED)
    if cached is not None and cached[0] is feature_map and cached[1] == group:
        kept: FeatureMap = cached[2]
        return kept
    untraced(_group_and_keep, module, feature_map, group)
    grouped_map: FeatureMap = module.__dict__[GROUPED][2]  # (read back, as in _feature_map)
    return grouped_map


def _group_and_keep(module: torch.nn.Module, feature_map: FeatureMap, group: int) -> FeatureMap:
    grouped_map = feature_map.grouped(group)
    module.__dict__[GROUPED] = (feature_map, group, grouped_map)
    return grouped_map


def _layer_index(module: torch.nn.Module) -> int:
    index = getattr(module, "layer_idx", None)
    return index if isinstance(index, int) else 0


# Available from import on (with the default options: register() sets them), so that a
# model loaded with attn_implementation="linattn", or converted, needs no register().
_register()
