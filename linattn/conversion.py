"""The conversion of a pretrained model's attention to fitted maps, layer by layer: the one
loop that every model family shares.

A model family supplies an adapter (:class:`Layers`): how many attention layers it has,
one layer's activations on a calibration split (:meth:`Layers.capture`), how a fitted
layer is installed (:meth:`Layers.install`) and, where the family streams its
activations, how the hidden states move past a layer (:meth:`Layers.advance`).
:func:`convert_layers` does the rest the same way for every family: the options'
checks, the fit of each layer (:func:`linattn.transfer.fit_layer`, seed ``seed + l``),
the exact heads, progress lines prefixed with the layer, resuming from the layers a
checkpoint holds, and a checkpoint after each layer.

The adapters: :mod:`linattn.models.convert` (the NumPy BERT encoder, activations
streamed) and :mod:`linattn.integrations.transformers.convert` (transformers models,
activations captured from the model's own forward pass).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from linattn.features import FeatureMap
from linattn.transfer import SINK_KEYS, LayerBatch, LayerFit, fit_layer

__all__ = [
    "STITCHES",
    "FitOptions",
    "Layers",
    "Progress",
    "check_conversion",
    "convert_layers",
    "prefixed",
]

#: How a layer's calibration activations are made: by the exact model (``"exact"``), or by
#: the model whose earlier layers are already converted (``"converted"``: each fit sees
#: the inputs it will meet).
STITCHES = ("exact", "converted")
Stitch = Literal["exact", "converted"]
#: Where progress lines go (one line each, no newline).
Progress = Callable[[str], None]


@dataclass(frozen=True)
class FitOptions:
    """What every layer's fit takes (:func:`linattn.transfer.fit_layer`'s options).

    ``seed`` is the first layer's: layer ``l`` fits with ``seed + l``.  ``exact_heads``
    query heads per layer attend exactly: the ones with the largest share of the layer's
    fitted error on the validation split (:meth:`linattn.transfer.LayerFit.worst_heads`).
    """

    num_features: int = 64
    window: int | None = 16
    sink_keys: int = SINK_KEYS
    steps: int = 300
    learning_rate: float = 1e-2
    seed: int = 0
    exact_heads: int = 0
    query_rows: int | None = None


class Layers(Protocol):
    """A model family's side of the conversion (one adapter per model)."""

    @property
    def count(self) -> int:
        """The number of attention layers, in the order they run."""
        ...

    def capture(self, layer: int, split: str) -> list[LayerBatch]:
        """Layer ``layer``'s queries, keys and values on the calibration ``split``
        (``"fit"`` or ``"validation"``), stitched as the adapter was asked."""
        ...

    def fit_options(self, layer: int) -> dict[str, Any]:
        """What the layer itself tells the fit (``causal``, ``scale``), after a capture."""
        ...

    def install(self, layer: int, feature_map: FeatureMap | None, heads: tuple[int, ...]) -> None:
        """Layer ``layer`` runs the fitted hybrid with ``feature_map`` from now on, and
        ``heads`` of its query heads attend exactly."""
        ...

    def advance(self, layer: int) -> None:
        """Move the calibration activations past ``layer`` (a no-op where every capture
        runs the model from its inputs)."""
        ...


def check_conversion(stitch: object, exact_heads: object) -> None:
    """The options every conversion checks before any work, named as given.

    Examples
    --------
    >>> check_conversion("exact", 0)
    >>> check_conversion("both", 0)
    Traceback (most recent call last):
    ...
    ValueError: stitch must be 'exact' or 'converted'; got 'both'
    """
    if stitch not in STITCHES:
        raise ValueError(f"stitch must be 'exact' or 'converted'; got {stitch!r}")
    if isinstance(exact_heads, bool) or not isinstance(exact_heads, int) or exact_heads < 0:
        raise ValueError(f"exact_heads must be an integer >= 0; got {exact_heads!r}")


def prefixed(progress: Progress | None, prefix: str) -> Progress | None:
    """``progress`` with each line prefixed (``"layer 3: "``); None stays None.

    Examples
    --------
    >>> lines = []
    >>> prefixed(lines.append, "layer 0: ")("step 1")
    >>> lines
    ['layer 0: step 1']
    """
    if progress is None:
        return None
    report = progress
    return lambda line: report(prefix + line)


def convert_layers(
    layers: Layers,
    options: FitOptions,
    *,
    progress: Progress | None = None,
    resumed: Sequence[tuple[FeatureMap | None, tuple[int, ...]]] = (),
    resumed_from: str = "",
    after_layer: Callable[[int], None] | None = None,
) -> list[LayerFit | None]:
    """Fit and install every layer of ``layers`` in order; each layer's fit (None where
    it was resumed).

    Parameters
    ----------
    layers : Layers
        The model family's adapter.
    options : FitOptions
    progress : callable, optional
        Receives the fits' progress lines, prefixed ``"layer l: "``.
    resumed : sequence of (map, exact heads)
        The first layers' results from a checkpoint: installed, not fitted again.
    resumed_from : str
        Where ``resumed`` came from (for the progress line).
    after_layer : callable, optional
        Called with each newly fitted layer's index once it is installed (to write a
        checkpoint).

    Examples
    --------
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> def batch():
    ...     q, k, v = (rng.normal(size=(1, 2, 12, 4)) for _ in range(3))
    ...     return LayerBatch(q, k, v, np.ones((1, 12), dtype=bool))
    >>> class Two:  # two layers of random activations
    ...     count = 2
    ...     installed = {}
    ...     def capture(self, layer, split): return [batch()]
    ...     def fit_options(self, layer): return {}
    ...     def install(self, layer, fm, heads): self.installed[layer] = fm.kind
    ...     def advance(self, layer): pass
    >>> model = Two()
    >>> fits = convert_layers(model, FitOptions(num_features=4, window=2, steps=2))
    >>> len(fits), model.installed
    (2, {0: 'hedgehog', 1: 'hedgehog'})
    """
    fits: list[LayerFit | None] = []
    for layer in range(layers.count):
        if layer < len(resumed):
            feature_map, heads = resumed[layer]
            layers.install(layer, feature_map, heads)
            fits.append(None)
            if progress is not None:
                progress(f"layer {layer}: resumed from {resumed_from}")
        else:
            fit_data = layers.capture(layer, "fit")
            validation = layers.capture(layer, "validation")
            result = fit_layer(
                fit_data, validation, num_features=options.num_features,
                window=options.window, sink_keys=options.sink_keys, steps=options.steps,
                learning_rate=options.learning_rate, seed=options.seed + layer,
                progress=prefixed(progress, f"layer {layer}: "), query_rows=options.query_rows,
                **layers.fit_options(layer),
            )  # fmt: skip
            del fit_data, validation
            layers.install(layer, result.feature_map, result.worst_heads(options.exact_heads))
            fits.append(result)
            if after_layer is not None:
                after_layer(layer)
        layers.advance(layer)
    return fits
