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
:func:`refine` fits the converted layers' maps together, end to end; :func:`save_fitted`
and :func:`load_fitted` keep the maps in a file, :func:`save_pretrained` saves the
converted model as one folder (maps inside) that ``AutoModel.from_pretrained`` and
``SentenceTransformer`` load, :func:`layer_errors` measures them.
Importing this package makes ``attn_implementation="linattn"`` available with the
default options.

One module per topic: :mod:`~linattn.integrations.transformers.options` (``register``'s
options, their checks, ``config.linattn``), :mod:`~linattn.integrations.transformers.attention`
(the attention function, key masks, exact keys and heads),
:mod:`~linattn.integrations.transformers.cache` (:class:`LinearAttentionCache`),
:mod:`~linattn.integrations.transformers.capture` (a conversion's capture hook and
passes), :mod:`~linattn.integrations.transformers.convert` (the conversion and its
adapter of :func:`linattn.conversion.convert_layers`),
:mod:`~linattn.integrations.transformers.files` (fingerprints, fitted-maps files),
:mod:`~linattn.integrations.transformers.refine`, and
:mod:`~linattn.integrations.transformers.state`: what the integration keeps on each
attention module, one :class:`LinattnState` record (:func:`state_of`).
"""

from __future__ import annotations

from linattn.integrations.transformers import _requires  # noqa: F401 (first: names what is missing)
from linattn.integrations.transformers.attention import (
    attention_forward,
    key_mask_from,
    make_available,
    register,
    special_keys,
    splice_exact_heads,
)
from linattn.integrations.transformers.cache import LinearAttentionCache
from linattn.integrations.transformers.capture import AttentionCall, capture_hook
from linattn.integrations.transformers.convert import convert, layer_errors
from linattn.integrations.transformers.files import (
    load_fitted,
    map_from_file,
    model_fingerprint,
    model_signature,
    module_fingerprint,
    save_fitted,
    save_pretrained,
)
from linattn.integrations.transformers.options import (
    DEFAULTS,
    NAME,
    ExactKeys,
    check_options,
    use_linattn,
)
from linattn.integrations.transformers.refine import LOSSES, refine
from linattn.integrations.transformers.state import LinattnState, state_of

__all__ = [
    "DEFAULTS",
    "LOSSES",
    "NAME",
    "AttentionCall",
    "ExactKeys",
    "LinattnState",
    "LinearAttentionCache",
    "attention_forward",
    "capture_hook",
    "check_options",
    "convert",
    "key_mask_from",
    "layer_errors",
    "load_fitted",
    "map_from_file",
    "model_fingerprint",
    "model_signature",
    "module_fingerprint",
    "refine",
    "register",
    "save_fitted",
    "save_pretrained",
    "special_keys",
    "splice_exact_heads",
    "state_of",
    "use_linattn",
]

# Available from import on (with the default options: register() sets them), so that a
# model loaded with attn_implementation="linattn", or converted, needs no register().
make_available()
