"""How far each attention estimator moves a pretrained sentence encoder: the measurements.

Two figures per configuration, both against the exact model:

* **per layer**, the relative error ``||A - A*||_F / ||A*||_F`` of the attention
  outputs over real (unpadded) query rows, each layer fed the *exact* model's hidden
  states, so that a layer's error is its own and not the sum of the layers before it;
* **end to end**, the cosine of each text's sentence embedding to the exact model's,
  every layer's attention replaced at once, summarised over all texts, the texts of
  128 tokens or more, and the texts truncated at the model's maximum length.

Plus the time of one encode of all texts and of the attention calls alone.  The
configurations (:func:`default_configs`) are random features alone, exact attention to a
window of neighbours, the window plus sink keys (position 0 and ``[CLS]``/``[SEP]``), and
the hybrid: window and sinks exact, random features for the far keys.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Literal

import numpy as np

import linattn as la
from linattn.features import Kind
from linattn.models.bert import Attention, exact_attention
from linattn.models.minilm import SentenceModel, Tokens

__all__ = [
    "LONG_TEXT",
    "Config",
    "ConfigResult",
    "default_configs",
    "hybrid_available",
    "load_texts",
    "make_attention",
    "measure",
]

#: Texts of at least this many tokens (``[CLS]``/``[SEP]`` included) count as long.
LONG_TEXT = 128
#: Families of configurations, in table order.
FAMILIES = ("reference", "features", "window", "window+sinks", "hybrid")


def load_texts(count: int | None = None) -> list[str]:
    """The benchmark's texts (``linattn/models/texts.txt``), the first ``count`` of them.

    Five texts per topic (``benchmarks/accuracy_texts.md``), so a multiple of five keeps
    the mix of short, long and truncated texts.

    Examples
    --------
    >>> len(load_texts()) >= 200, len(load_texts(10))
    (True, 10)
    """
    lines = resources.files("linattn.models").joinpath("texts.txt").read_text("utf-8")
    texts = [line.strip() for line in lines.splitlines() if line.strip()]
    if count is not None:
        if count < 1:
            raise ValueError(f"count must be a positive number of texts; got {count}")
        texts = texts[:count]
    return texts


def hybrid_available() -> bool:
    """Whether ``linattn.linear_attention`` takes ``window``, ``sink_keys``, ``exact_key_mask``."""
    parameters = inspect.signature(la.linear_attention).parameters
    return all(name in parameters for name in ("window", "sink_keys", "exact_key_mask"))


@dataclass(frozen=True)
class Config:
    """One way to compute every layer's attention.

    ``kind``/``num_features`` set the random features (None: far keys dropped);
    ``window`` the exact neighbours; ``sinks`` adds the first ``sink_keys`` positions
    as sink keys and ``[CLS]``/``[SEP]`` as exact keys; ``shared_draw`` gives every
    layer the same projection (the estimators' errors then correlate across layers).
    """

    family: str
    kind: Kind | Literal["uniform"] | None = None
    num_features: int | None = None
    rebalance: bool = False
    window: int | None = None
    sinks: bool = False
    sink_keys: int = 1
    shared_draw: bool = False
    fitted: str | None = None

    @property
    def label(self) -> str:
        parts = []
        if self.window is not None:
            parts.append(f"w={self.window}")
        if self.sinks:
            parts.append("sinks" if self.sink_keys == 1 else f"{self.sink_keys} sinks")
        if self.fitted is not None:
            return " + ".join([*parts, f"fitted ({self.fitted})"])
        if self.kind is not None:
            kind = self.kind + ("+rebalance" if self.rebalance else "")
            parts.append(f"{kind} m={self.num_features}")
            if self.shared_draw:
                parts.append("one draw")
        return " + ".join(parts) or self.family

    @property
    def needs_hybrid_api(self) -> bool:
        return self.window is not None or self.sinks


def default_configs() -> list[Config]:
    """The measured configurations: the issue's grid (see the module docstring)."""
    estimators: list[tuple[Kind, bool]] = [
        ("positive", False),
        ("hyperbolic", False),
        ("oprf", False),
        ("hyperbolic_oprf", True),
    ]
    configs = [Config("reference", kind="uniform")]
    configs += [
        Config("features", kind=kind, num_features=m, rebalance=rebalance)
        for kind, rebalance in estimators
        for m in (64, 256)
    ]
    windows = (4, 16, 64)
    hybrids: list[tuple[Kind, bool]] = [("positive", False), ("hyperbolic_oprf", True)]
    configs += [Config("window", window=w) for w in windows]
    configs += [Config("window+sinks", window=w, sinks=True) for w in windows]
    configs += [
        Config("hybrid", kind=kind, num_features=256, rebalance=rebalance, window=w, sinks=True)
        for kind, rebalance in hybrids
        for w in windows
    ]
    return configs


def uniform_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, key_mask: np.ndarray, layer: int
) -> np.ndarray:
    """Every query takes the mean of the real values: the error of knowing nothing."""
    weights = key_mask[:, None, :, None].astype(v.dtype)
    mean = (v * weights).sum(axis=-2, keepdims=True) / weights.sum(axis=-2, keepdims=True)
    return np.broadcast_to(mean, q.shape[:-1] + v.shape[-1:])


def cls_sep_mask(key_mask: np.ndarray) -> np.ndarray:
    """``(B, 1, L)``: each row's first and last real token (``[CLS]`` and ``[SEP]``)."""
    exact = np.zeros(key_mask.shape, dtype=bool)
    exact[:, 0] = True
    exact[np.arange(len(key_mask)), key_mask.sum(axis=1) - 1] = True
    mask: np.ndarray = (exact & key_mask)[:, None, :]
    return mask


def make_attention(config: Config, head_dim: int, seed: int = 0) -> Attention:
    """The attention callable of ``config``; layer ``l`` draws features with seed ``seed + l``
    (``seed`` in every layer with ``config.shared_draw``).

    OPRF and rebalanced maps are calibrated per call on the real queries and keys.

    Raises
    ------
    NotImplementedError
        ``config`` needs ``window``/``sink_keys``, which this linattn lacks.

    Examples
    --------
    >>> attention = make_attention(Config("features", kind="positive", num_features=16), 8)
    >>> q = k = v = np.ones((1, 1, 3, 8), dtype=np.float32)
    >>> attention(q, k, v, np.array([[True, True, False]]), 0).shape
    (1, 1, 3, 8)
    """
    if config.kind == "uniform":
        return uniform_attention
    kind = config.kind
    if config.needs_hybrid_api and not hybrid_available():
        raise NotImplementedError(
            f"{config.label} needs linear_attention(window=, sink_keys=, exact_key_mask=), "
            "which this linattn does not have"
        )
    maps: dict[int, la.FeatureMap] = {}

    def feature_map(layer: int) -> la.FeatureMap | None:
        if kind is None or config.num_features is None:
            return None
        if layer not in maps:
            maps[layer] = la.FeatureMap(
                head_dim,
                config.num_features,
                kind=kind,
                rebalance=config.rebalance,
                seed=seed if config.shared_draw else seed + layer,
            )
        return maps[layer]

    def attention(
        q: np.ndarray, k: np.ndarray, v: np.ndarray, key_mask: np.ndarray, layer: int
    ) -> np.ndarray:
        # (B, 1, L): the padding mask of (B, H, L, d) keys (a (B, L) mask would be read
        # as a mask over heads by a linattn without the rank rule).
        mask = key_mask[:, None, :]
        fm = feature_map(layer)
        if fm is not None and fm.needs_calibration:
            fm = fm.calibrate(q, k, key_mask=mask, query_mask=mask)
        extra: dict[str, Any] = {}
        if config.window is not None:
            extra["window"] = config.window
        if config.sinks:
            extra.update(sink_keys=config.sink_keys, exact_key_mask=cls_sep_mask(key_mask))
        out: np.ndarray = la.linear_attention(q, k, v, fm, key_mask=mask, **extra)
        return out

    return attention


@dataclass
class ConfigResult:
    """The figures of one configuration (``available`` False: the reason is in ``note``)."""

    config: Config
    available: bool = True
    note: str = ""
    layer_errors: np.ndarray = field(default_factory=lambda: np.zeros(0))
    head_errors: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    cosines: np.ndarray = field(default_factory=lambda: np.zeros(0))
    encode_seconds: float = float("nan")
    attention_seconds: float = float("nan")

    def cosine_summary(self, lengths: np.ndarray, truncated: np.ndarray) -> dict[str, float]:
        """Mean and minimum cosine over all texts, the long ones, and the truncated ones."""
        groups = {"all": np.ones_like(truncated), "long": lengths >= LONG_TEXT, "trunc": truncated}
        out: dict[str, float] = {}
        for name, chosen in groups.items():
            values = self.cosines[chosen] if self.available else np.zeros(0)
            out[f"mean_{name}"] = float(values.mean()) if values.size else float("nan")
            out[f"min_{name}"] = float(values.min()) if values.size else float("nan")
        return out


@dataclass
class Measurement:
    """Every configuration's figures on one set of texts."""

    results: list[ConfigResult]
    lengths: np.ndarray
    truncated: np.ndarray
    exact_encode_seconds: float
    exact_attention_seconds: float

    def as_dict(self) -> dict[str, Any]:
        rows = []
        for result in self.results:
            row: dict[str, Any] = {
                "family": result.config.family,
                "config": result.config.label,
                "available": result.available,
                "note": result.note,
            }
            if result.available:
                row["layer_errors"] = [round(float(e), 5) for e in result.layer_errors]
                row["head_errors"] = np.round(result.head_errors, 4).tolist()
                row.update(result.cosine_summary(self.lengths, self.truncated))
                row["encode_seconds"] = result.encode_seconds
                row["attention_seconds"] = result.attention_seconds
            rows.append(row)
        return {
            "texts": len(self.lengths),
            "long_texts": int((self.lengths >= LONG_TEXT).sum()),
            "truncated_texts": int(self.truncated.sum()),
            "exact_encode_seconds": self.exact_encode_seconds,
            "exact_attention_seconds": self.exact_attention_seconds,
            "results": rows,
        }


def _batches(tokens: Tokens, batch_size: int) -> list[np.ndarray]:
    """Text indices in batches of similar length: little padding to compute on."""
    order = np.argsort(tokens.lengths, kind="stable")
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


class _Recorder:
    """Exact attention that keeps each layer's inputs and output (the reference)."""

    def __init__(self) -> None:
        self.layers: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self.seconds = 0.0

    def __call__(
        self, q: np.ndarray, k: np.ndarray, v: np.ndarray, key_mask: np.ndarray, layer: int
    ) -> np.ndarray:
        start = time.perf_counter()
        out = exact_attention(q, k, v, key_mask, layer)
        self.seconds += time.perf_counter() - start
        self.layers.append((q, k, v, out))
        return out


def measure(
    model: SentenceModel,
    texts: Sequence[str],
    configs: Sequence[Config],
    *,
    batch_size: int = 16,
    seed: int = 0,
    on_step: Callable[[], None] = lambda: None,
) -> Measurement:
    """Per-layer attention errors and embedding cosines of ``configs`` against the exact model.

    ``on_step`` is called once per configuration and batch (and once per batch for the
    exact model).

    Examples
    --------
    >>> from linattn.models import load_model  # doctest: +SKIP
    >>> m = measure(load_model("minilm"), load_texts(10), default_configs()[:2])  # doctest: +SKIP
    >>> m.results[1].config.label  # doctest: +SKIP
    'positive m=64'
    """
    encoder = model.encoder
    layers, heads = encoder.config.num_layers, encoder.config.num_heads
    tokens = model.tokenize(list(texts))
    attentions: dict[int, Attention] = {}
    results = []
    for index, config in enumerate(configs):
        result = ConfigResult(config)
        try:
            if config.fitted is not None:
                from linattn.models.convert import attention_from_file

                attentions[index] = attention_from_file(config.fitted, encoder)
            else:
                attentions[index] = make_attention(config, encoder.config.head_dim, seed)
        except NotImplementedError as error:
            result.available, result.note = False, str(error)
        else:
            result.layer_errors = np.zeros(layers)
            result.head_errors = np.zeros((layers, heads))
            result.cosines = np.zeros(len(texts))
            result.encode_seconds = result.attention_seconds = 0.0
        results.append(result)
    squared = {i: np.zeros((layers, heads)) for i in attentions}
    reference = np.zeros((layers, heads))
    exact_seconds = exact_attention_seconds = 0.0
    for rows in _batches(tokens, batch_size):
        mask = tokens.key_mask[rows]
        width = int(mask.sum(axis=1).max())
        ids, mask = tokens.input_ids[rows, :width], mask[:, :width]
        recorder = _Recorder()
        start = time.perf_counter()
        exact = encoder.encode(ids, mask, recorder)
        exact_seconds += time.perf_counter() - start
        exact_attention_seconds += recorder.seconds
        rows_real = mask[:, None, :, None]  # real query rows: the only ones compared
        for layer, (_, _, _, out) in enumerate(recorder.layers):
            reference[layer] += np.sum(np.where(rows_real, out, 0.0) ** 2, axis=(0, 2, 3))
        on_step()
        for index, attention in attentions.items():
            result = results[index]
            for layer, (q, k, v, out) in enumerate(recorder.layers):
                start = time.perf_counter()
                estimate = np.asarray(attention(q, k, v, mask, layer), dtype=np.float64)
                result.attention_seconds += time.perf_counter() - start
                difference = np.where(rows_real, estimate - out, 0.0)
                squared[index][layer] += np.sum(difference**2, axis=(0, 2, 3))
            start = time.perf_counter()
            embeddings = encoder.encode(ids, mask, attention)
            result.encode_seconds += time.perf_counter() - start
            result.cosines[rows] = np.sum(embeddings * exact, axis=-1)
            on_step()
    for index in attentions:
        result = results[index]
        result.head_errors = np.sqrt(squared[index] / reference)
        result.layer_errors = np.sqrt(squared[index].sum(axis=1) / reference.sum(axis=1))
    return Measurement(
        results, tokens.lengths, tokens.truncated, exact_seconds, exact_attention_seconds
    )
