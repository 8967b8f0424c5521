"""Longer inputs for an absolute-position encoder, without training: its position table
stretched to more positions (position interpolation).

A BERT-like encoder learns one embedding per position up to ``max_position_embeddings``
(512 for all-MiniLM-L6-v2) and has none beyond.  :func:`extend_positions` gives it a
table of ``length`` rows made from the learned one (LongEmbed, Zhu et al. 2024, section
4: training-free extension of absolute-position embedding models):

- ``"interpolate"`` (position interpolation, the default): position ``p`` of the new table
  is the learned table read at ``p (n - 1) / (length - 1)``, linearly between its two
  nearest rows; the first and last rows are the learned first and last;
- ``"group"`` (grouped positions): position ``p`` takes row ``floor(p n / length)``, so
  ``length / n`` neighbouring tokens share one learned position.

Either way the whole table changes, short inputs' positions too: an extended model is a
*different* model from the original at every length, the price of one table for every
length.  The exact reference a converted model is measured against must be extended the
same way (:func:`extend_positions` on both); ``docs/long-documents.md`` gives what it
costs at 512 tokens.  Models with rotary positions (Llama-like decoders) need no table:
their positions extend by themselves, and ``linattn convert`` leaves them alone.

Examples
--------
>>> import numpy as np
>>> table = np.array([[0.0, 0.0], [1.0, 2.0], [2.0, 4.0]])
>>> extended_table(table, 5, "interpolate")
array([[0. , 0. ],
       [0.5, 1. ],
       [1. , 2. ],
       [1.5, 3. ],
       [2. , 4. ]])
>>> extended_table(table, 6, "group")[:, 0]
array([0., 0., 1., 1., 2., 2.])
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["METHODS", "POSITIONS_ENTRY", "extend_positions", "extended_table", "position_count"]

#: The ways of stretching a table (:func:`extended_table`).
METHODS = ("interpolate", "group")

#: Where a model (its ``config``) and a fitted-maps file (its options) record an extension:
#: ``{"method": ..., "original": n, "length": N}``.
POSITIONS_ENTRY = "position_extension"

_TABLE = "embeddings.position_embeddings.weight"


def extended_table(table: np.ndarray, length: int, method: str = "interpolate") -> np.ndarray:
    """A position table of ``length`` rows made from ``table`` (``n`` rows, ``length >=
    n``) by ``method`` (:data:`METHODS`); ``length == n`` returns it unchanged."""
    table = np.asarray(table)
    n = table.shape[0]
    _check(length, method, n)
    out: np.ndarray
    if length == n:
        out = table.copy()
        return out
    positions = np.arange(length, dtype=np.float64)
    if method == "group":
        out = table[np.floor(positions * n / length).astype(np.int64)].copy()
        return out
    source = positions * (n - 1) / (length - 1)
    low = np.minimum(np.floor(source).astype(np.int64), n - 2)
    frac = (source - low)[:, None]
    out = (table[low] * (1.0 - frac) + table[low + 1] * frac).astype(table.dtype, copy=False)
    return out


def position_count(model: Any) -> int:
    """How many positions ``model`` has (its position table's rows): a
    ``linattn.models.bert.BertEncoder`` or a transformers BERT-like model."""
    if hasattr(model, "weights") and _TABLE in getattr(model, "weights", {}):
        return int(model.weights[_TABLE].shape[0])
    embeddings = _transformers_embeddings(model)
    return int(embeddings.position_embeddings.weight.shape[0])


def extend_positions(model: Any, length: int, method: str = "interpolate") -> dict[str, Any]:
    """Give ``model`` a position table of ``length`` rows (in place) and return what was
    done, ``{"method", "original", "length"}`` (also recorded as
    ``model.config.position_extension`` for transformers models).

    Parameters
    ----------
    model : BertEncoder or transformers model
        A ``linattn.models.bert.BertEncoder`` (its weights dict), or a transformers
        model with BERT's embeddings (``embeddings.position_embeddings``, e.g.
        ``BertModel``; a ``SentenceTransformer``'s ``[0].auto_model``).
    length : int
        Positions wanted, at least the model's own (equal: nothing changes).
    method : {"interpolate", "group"}
        :func:`extended_table`'s.

    Raises
    ------
    ValueError
        ``length`` below the model's positions, or an unknown ``method``; a model already
        extended (extend the original instead).
    TypeError
        A model without an absolute position table (rotary models need none).

    Examples
    --------
    >>> from linattn.models.bert import BertConfig, BertEncoder, random_weights
    >>> config = BertConfig(8, 2, 1, 1e-12)
    >>> encoder = BertEncoder(random_weights(config, 50), config)
    >>> extend_positions(encoder, 2048)
    {'method': 'interpolate', 'original': 512, 'length': 2048}
    >>> position_count(encoder)
    2048
    """
    if hasattr(model, "weights") and _TABLE in getattr(model, "weights", {}):
        table = model.weights[_TABLE]
        _check(length, method, table.shape[0])
        if getattr(model, "position_extension", None):
            raise ValueError(_EXTENDED.format(model.position_extension))
        record = {"method": method, "original": int(table.shape[0]), "length": int(length)}
        if length > table.shape[0]:
            model.weights[_TABLE] = extended_table(table, length, method)
            model.position_extension = record
        return record
    embeddings = _transformers_embeddings(model)
    import torch

    old = embeddings.position_embeddings
    n = int(old.weight.shape[0])
    _check(length, method, n)
    config = getattr(model, "config", None)
    done = getattr(config, POSITIONS_ENTRY, None)
    if done:
        raise ValueError(_EXTENDED.format(done))
    record = {"method": method, "original": n, "length": int(length)}
    if length == n:
        return record
    host = old.weight.detach().to("cpu", torch.float64).numpy()
    weight = torch.from_numpy(extended_table(host, length, method))
    new = torch.nn.Embedding(length, int(old.weight.shape[1]))
    new.weight.data = weight.to(old.weight.device, old.weight.dtype)
    new.weight.requires_grad_(old.weight.requires_grad)
    embeddings.position_embeddings = new
    device = embeddings.position_ids.device
    embeddings.position_ids = torch.arange(length, device=device).expand((1, -1))
    if hasattr(embeddings, "token_type_ids"):
        embeddings.token_type_ids = torch.zeros((1, length), dtype=torch.long, device=device)
    if config is not None:
        config.max_position_embeddings = int(length)
        setattr(config, POSITIONS_ENTRY, record)
    return record


_EXTENDED = "the model's positions are extended already ({}): extend the original model"


def _check(length: object, method: object, n: int) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")
    if isinstance(length, bool) or not isinstance(length, int | np.integer) or length < n:
        raise ValueError(
            f"length must be an integer of at least the model's {n} positions; got {length!r}"
        )
    if n < 2:
        raise ValueError(f"a position table needs at least 2 rows to extend; got {n}")


def _transformers_embeddings(model: Any) -> Any:
    """``model``'s BERT-like embeddings module, or TypeError naming what it lacks."""
    base = getattr(model, "base_model", model)
    embeddings = getattr(base, "embeddings", None)
    table = getattr(embeddings, "position_embeddings", None)
    if table is None or not hasattr(table, "weight") or not hasattr(embeddings, "position_ids"):
        raise TypeError(
            "model must be a linattn.models.bert.BertEncoder or a transformers model with "
            "BERT's absolute position table (embeddings.position_embeddings); got "
            f"{type(model).__name__}, which has none (rotary models need no extension)"
        )
    return embeddings
