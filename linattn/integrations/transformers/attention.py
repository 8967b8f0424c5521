"""The attention function transformers calls for ``attn_implementation="linattn"``.

:func:`register` adds :func:`attention_forward` to transformers' ``AttentionInterface``.
It borrows SDPA's mask function, so the attention receives a boolean 4-D mask (or None
for a plain causal one), accepted when it is padding, optionally causal, only
(:func:`key_mask_from`).  Exact keys are derived per row from the mask
(:func:`special_keys`, or the user's rule); the map is the module's fitted one, else a
random one drawn on its first call, both kept in the module's record
(:mod:`linattn.integrations.transformers.state`).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from linattn._checks import SCALE_TOLERANCE
from linattn._gqa import grouped
from linattn._xp import namespace_of, require, untraced
from linattn.attention import linear_attention, with_exact_heads
from linattn.features import SOFTMAX_KINDS, FeatureMap
from linattn.integrations.transformers.cache import take_layer
from linattn.integrations.transformers.capture import AttentionCall, capture_hook
from linattn.integrations.transformers.files import map_from_file, resolve_fitted
from linattn.integrations.transformers.options import NAME, options_for, set_options
from linattn.integrations.transformers.order import SinksFirst
from linattn.integrations.transformers.state import state_of, update

__all__ = [
    "attention_forward",
    "key_mask_from",
    "make_available",
    "register",
    "special_keys",
    "splice_exact_heads",
]


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
        in BERT models, found from the attention mask), ``"sep"`` for the last alone
        (as ``linattn convert`` fits), or a callable taking the
        ``(B, L_k)`` boolean key mask (True for real tokens; all True without padding)
        and returning a ``(B, L_k)`` boolean tensor (True for the exact keys).  A
        model's ``config.linattn = {...}`` overrides them per model.

    Raises
    ------
    TypeError
        An unknown option.
    ValueError
        An option's value (see
        :func:`linattn.integrations.transformers.options.check_options`).

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
    set_options(**options)
    make_available()


def make_available() -> None:
    """Register :func:`attention_forward` as ``attn_implementation="linattn"`` (with
    SDPA's mask function), leaving the options as they are: done on import."""
    AttentionInterface.register(NAME, attention_forward)
    # Without a mask function of its own an implementation gets no mask at all; SDPA's
    # boolean 4-D masks (None where causality alone says it all) are converted below.
    AttentionMaskInterface.register(NAME, sdpa_mask)


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
    settings = options_for(module)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))
    layer = take_layer()
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
    length = int(key.shape[-2]) if layer is None else layer.seen  # (the cache's too)
    feature_map = _feature_map(module, settings, query.shape[-1], scaling, causal, length)
    # Sinks are each row's first real tokens (left padding too): rows reordered so that
    # they come first, on a decoding state's first call only (later tokens are real).
    reorder = (
        SinksFirst.of(key_mask, settings["sink_keys"], causal)
        if (layer is None or layer.state is None) and query.shape[-2] == key.shape[-2]
        else None
    )
    inputs, call_mask = (query, key, value), key_mask
    if reorder is not None:
        assert key_mask is not None  # (a reordering needs one)
        q, k, v, call_mask, exact_key_mask = reorder.take_call(
            query, key, value, key_mask, exact_key_mask
        )
        inputs = (q, k, v)
    q, k, v, grouped_mask, ungroup = grouped(*inputs, call_mask)
    if feature_map is not None and q.ndim > query.ndim:  # per-head parameters: grouped too
        feature_map = _grouped_map(module, feature_map, int(q.shape[-3]))
    if exact_key_mask is not None:  # shaped like the key mask, grouped alike
        exact_key_mask = grouped(*inputs, exact_key_mask)[3]
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
        if reorder is not None:
            out = reorder.restore(out)
        heads = state_of(module).exact_heads
        if layer is not None and heads:
            out = layer.exact_heads(out, query, key, value, key_mask, scaling, heads)
        else:
            out = splice_exact_heads(module, out, query, key, value, key_mask, causal, scaling)
    return out.transpose(1, 2).contiguous(), None


def last_keys(key_mask: torch.Tensor) -> torch.Tensor:
    """Each row's last real token (``[SEP]`` in BERT models), ``(..., L_k)`` boolean
    (none in a row without one).

    Examples
    --------
    >>> import torch
    >>> last_keys(torch.tensor([[1, 1, 1, 0], [0, 1, 1, 0]], dtype=torch.bool)).int()
    tensor([[0, 0, 1, 0],
            [0, 0, 1, 0]], dtype=torch.int32)
    """
    positions = torch.arange(key_mask.shape[-1], device=key_mask.device)
    last = torch.where(key_mask, positions, -1).amax(dim=-1, keepdim=True)
    return (positions == last) & key_mask


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
    if torch.compiler.is_compiling():  # (no state kept while tracing)
        return _key_mask_from_4d(attention_mask, query_length, key_length, causal)
    # Every layer of a forward pass gets the same mask: it is read once, and the next
    # layers compare theirs with a copy of it (one comparison instead of a dozen passes).
    global _LAST_MASK
    key = (query_length, key_length, causal, torch.is_inference_mode_enabled())
    last = _LAST_MASK
    if (
        last is not None
        and last[0] == key
        and last[1].shape == attention_mask.shape
        and last[1].dtype == attention_mask.dtype
        and last[1].device == attention_mask.device
        and bool(torch.equal(last[1], attention_mask))
    ):
        return last[2]
    result = _key_mask_from_4d(attention_mask, query_length, key_length, causal)
    if attention_mask.numel() <= _MASK_COPY_LIMIT:
        _LAST_MASK = (key, attention_mask.clone(), result)
    return result


#: The last 4-D mask :func:`key_mask_from` read: (its lengths, causal flag and inference
#: mode; a copy of it; the result).  Only masks of at most ``_MASK_COPY_LIMIT`` entries
#: are kept.
_LAST_MASK: tuple[tuple[Any, ...], torch.Tensor, tuple[torch.Tensor | None, bool]] | None = None
_MASK_COPY_LIMIT = 1 << 24


def _key_mask_from_4d(
    attention_mask: torch.Tensor, query_length: int, key_length: int, causal: bool | None
) -> tuple[torch.Tensor | None, bool]:
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


def splice_exact_heads(
    module: torch.nn.Module,
    out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_mask: torch.Tensor | None,
    causal: bool,
    scaling: float | None,
) -> torch.Tensor:
    """``out`` ``(B, H, L_q, d_v)`` with ``module``'s exact heads (its record's)
    replaced by softmax attention over every real key (:func:`linattn.with_exact_heads`:
    those heads only, query head ``h`` reading key head ``h // (H / H_kv)``, zeros for
    rows without a key)."""
    heads = state_of(module).exact_heads
    if not heads:
        return out
    spliced: torch.Tensor = with_exact_heads(
        out, query, key, value, heads, causal=causal, key_mask=key_mask, scale=scaling
    )
    return spliced


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
    if rule == "sep":  # each row's last real token ([SEP]): linattn convert's exact key
        return last_keys(mask)[:, None]
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
    length: int = 0,
) -> FeatureMap | None:
    """One map per layer, kept on the module (the same projection every call).

    A fitted map (:func:`~linattn.integrations.transformers.convert`,
    :func:`~linattn.integrations.transformers.load_fitted`, or the file
    ``config.linattn["fitted"]`` names, read on the module's first call) comes first.
    A map is read or drawn on the module's first call only, outside ``torch.compile``'s
    graph (a model compiled before any eager call keeps a graph break there).
    """
    fitted = state_of(module).fitted
    if fitted is None and settings.get("fitted") is not None:
        path = resolve_fitted(settings["fitted"], getattr(module, "config", None))
        untraced(map_from_file, module, path, settings)  # keeps it on module
        fitted = state_of(module).fitted  # (read back: a value torch.compile can guard)
    if fitted is not None:
        _check_calibrated_length(module, length)
        expected = head_dim**-0.5 if scaling is None else scaling
        if fitted.head_dim != head_dim or not math.isclose(
            fitted.scale, expected, rel_tol=SCALE_TOLERANCE
        ):
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
    state = state_of(module)
    if state.drawn is not None and state.drawn_for == key:
        return state.drawn
    untraced(_draw, module, key, settings, head_dim, scaling, causal)
    drawn = state_of(module).drawn  # (read back, as above)
    assert drawn is not None
    return drawn


#: The calibrated lengths a longer call has warned about (once each, per process).
_WARNED_LENGTHS: set[int] = set()


def _check_calibrated_length(module: torch.nn.Module, length: int) -> None:
    """Warn once when a call is longer than the fitted map's calibration inputs (it runs,
    outside the calibrated range), as :func:`linattn.models.convert.attention_from_file`
    does on the NumPy route."""
    calibrated = state_of(module).calibrated_length
    if calibrated is None or length <= calibrated or torch.compiler.is_compiling():
        return
    if calibrated not in _WARNED_LENGTHS:
        _WARNED_LENGTHS.add(calibrated)
        warnings.warn(
            f"the fitted maps were calibrated on inputs of up to {calibrated} tokens; this "
            f"one has {length}: it runs, outside the calibrated range (convert with "
            "--max-length to calibrate at this length)",
            stacklevel=4,
        )


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
    update(module, drawn=feature_map, drawn_for=key)
    return feature_map


def _grouped_map(module: torch.nn.Module, feature_map: FeatureMap, group: int) -> FeatureMap:
    """``feature_map.grouped(group)`` (grouped-query heads), kept on the module: the
    host arrays are made on the module's first call only, outside ``torch.compile``'s
    graph (a model compiled before any eager call keeps a graph break there)."""
    state = state_of(module)
    made = state.grouped_from  # (its map compared by identity: maps hold arrays)
    if made is None or made[0] is not feature_map or made[1] != group:
        untraced(_group_and_keep, module, feature_map, group)
        state = state_of(module)  # (read back, as in _feature_map)
    assert state.grouped is not None
    return state.grouped


def _group_and_keep(module: torch.nn.Module, feature_map: FeatureMap, group: int) -> FeatureMap:
    grouped_map = feature_map.grouped(group)
    update(module, grouped=grouped_map, grouped_from=(feature_map, group))
    return grouped_map


def _layer_index(module: torch.nn.Module) -> int:
    index = getattr(module, "layer_idx", None)
    return index if isinstance(index, int) else 0
