"""Attention transfer: fit a layer's feature maps and far weights to its exact attention.

LoLCATs' attention transfer (Zhang et al., ICLR 2025) with Hedgehog maps (Zhang et al.,
ICLR 2024), every model weight frozen: for one attention layer, given its queries,
keys and values on calibration inputs, fit per head a query map, a key map
(:mod:`linattn.fitted`) and the far weight ``g`` so that the hybrid

    out_i = (sum_near exp(s q_i.k_j) v_j + g sum_far phi(q_i).phi(k_j) v_j) / (same with 1)

matches the layer's exact softmax output: the mean squared error over real query rows.
The near keys are those of :func:`linattn.linear_attention`'s ``window``,
``sink_keys`` and ``exact_key_mask``; far keys are every other real key (and, causal,
not a future one).

The fit runs on whatever arrays the activations are (NumPy with no framework, torch,
JAX, CuPy), with the library's own gradients (dense ``L x L`` per batch: calibration
texts are short) and an Adam step on host parameters, deterministic for a seed.
Three disjoint splits: ``fit`` (the gradient steps), ``validation`` (early stopping per
head, and ``g = 0`` for a head whose fit does not beat the exact parts alone there),
and a test split the caller keeps for every reported figure.

The math is in ``docs/algorithm.md`` (section "Fitted feature maps"); the procedure and
the figures that chose it in ``docs/estimators.md`` ("Converting a pretrained model").

The package, one topic a module, each importing only modules named before it:
:mod:`~linattn.transfer.threads` (:data:`PIECES`: each batch in pieces of rows on
threads, BLAS on one), :mod:`~linattn.transfer.batches` (:class:`LayerBatch`, and what
the loss needs of each batch), :mod:`~linattn.transfer.loss` (the dense hybrid, its
squared error and gradients; :func:`attention_errors`),
:mod:`~linattn.transfer.optimiser` (Adam on host parameters),
:mod:`~linattn.transfer.start` (the far weight's start), :mod:`~linattn.transfer.fit`
(:func:`fit_layer`: the steps, early stopping, :class:`LayerFit`) and, apart,
:mod:`~linattn.transfer.files` (:func:`save_maps`, :func:`load_maps`,
:func:`exact_heads_of`).
"""

from __future__ import annotations

from linattn.transfer.batches import LayerBatch
from linattn.transfer.files import EXACT_HEADS_ENTRY, FORMAT, exact_heads_of, load_maps, save_maps
from linattn.transfer.fit import MIN_GAIN as MIN_GAIN
from linattn.transfer.fit import SINK_KEYS, LayerFit, fit_layer
from linattn.transfer.loss import attention_errors
from linattn.transfer.threads import PIECES

__all__ = [
    "EXACT_HEADS_ENTRY",
    "FORMAT",
    "PIECES",
    "SINK_KEYS",
    "LayerBatch",
    "LayerFit",
    "attention_errors",
    "exact_heads_of",
    "fit_layer",
    "load_maps",
    "save_maps",
]
