"""Long documents: passkey and needle retrieval, fidelity and speed of all-MiniLM-L6-v2
with its positions extended, exact attention against its converted (linear) forms.

The synthetic tasks follow LongEmbed's construction (Zhu et al. 2024; built from its
published description, nothing downloaded):

- **passkey** (from "personalized passkey retrieval"): each document is a filler text
  ("The grass is green. The sky is blue. ...", repeated) with one sentence ``"<name>'s
  pass key is <key>. Remember it. <key> is the pass key for <name>."`` at a depth; the
  query is ``"what is the pass key for <name>?"``;
- **needle**: each document is a haystack of prose with one sentence ``"The best thing
  to do in <city> is <activity>."`` at a depth; the query is ``"What is the best thing
  to do in <city>?"``.

At each length ``L`` there are ``--count`` documents per task (depths spread evenly
from 0 to 1, names, keys, cities and activities drawn with the seed); each query is
ranked against every document of its task and length, and **nDCG@1** is the share of
queries whose own document ranks first (one relevant document each).  The haystack and
the fidelity documents are sentences of the Python reference manual that ships with
Python (``pydoc_data.topics``): text the calibration (``linattn/models/texts.txt``)
never contains.  **Fidelity** is the mean and minimum cosine of each configuration's
document embeddings to the exact model's, on ``--count`` such documents per length.

The model at length ``L`` is all-MiniLM-L6-v2 with its position table interpolated to
``L`` (:func:`linattn.models.positions.extend_positions`; the original model up to 512
tokens), the same for every configuration but chunk-and-average:

- ``exact``: softmax attention (NumPy, in row blocks), up to ``--exact-up-to`` tokens;
- ``chunks``: what users do today, the original model on 512-token pieces (each with
  its own ``[CLS]``/``[SEP]``), the pieces' embeddings averaged and normalised; queries
  by the original model too;
- ``window``: window 16 + 4 sinks + ``[SEP]`` exact, far keys dropped: the fitted hybrid
  with every far weight 0 (the ablation: what the far part adds);
- ``hybrid``: the same exact parts, random hyperbolic features for the far keys, m = 256;
- ``fitted-512``, ``fitted-2k``: the fitted maps of ``linattn convert`` calibrated at
  512 tokens (``--fitted-512 DIR``) and at 2,048 (``--fitted-2k DIR``), used on the
  model extended to ``L`` (so on other positions than they were fitted on beyond their
  length: the figures measure how they transfer).

Time per document is the mean encode time of the ``--count`` documents of one task;
peak memory is the process's peak resident set size during one document's encode less
its size before (``/proc/self/status``, reset through ``clear_refs``).  Numba kernels
and torch run ``--threads`` threads.

    linattn convert --model minilm --texts linattn/models/texts.txt --max-length 512 \\
        --pack --out fitted-512
    linattn convert --model minilm --texts linattn/models/texts.txt --max-length 2048 \\
        --pack --out fitted-2k
    python benchmarks/long_documents.py --fitted-512 fitted-512 --fitted-2k fitted-2k \\
        --lengths 256 512 1024 2048 4096 8192 16384 32768 --count 6 --json long.json \\
        --plot long.png
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from hf_model_speed import _peak, _reset_peak, _rss

from linattn.models.positions import METHODS

PASSKEY_FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)
NAMES = (
    "Adele", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas",
    "Keiko", "Lorenzo", "Mira", "Nikolai", "Olga", "Pablo", "Quentin", "Rosa", "Stefan",
    "Tomoko", "Ulrich", "Vera", "Walter", "Ximena", "Yusuf", "Zofia",
)  # fmt: skip
CITIES = (
    "Lisbon", "Oslo", "Krakow", "Valparaiso", "Hanoi", "Nairobi", "Quebec", "Tbilisi",
    "Porto", "Kyoto", "Seville", "Tallinn", "Cusco", "Zanzibar", "Reykjavik", "Bergen",
    "Trieste", "Marrakesh", "Ghent", "Ljubljana",
)  # fmt: skip
ACTIVITIES = (
    "ride the old funicular at dawn", "eat grilled sardines by the harbour",
    "swim in the cold fjord", "walk the city walls at dusk", "drink coffee in the market",
    "visit the salt mines", "climb the hill behind the cathedral", "rent a bicycle by the river",
    "listen to street musicians in the square", "take the night ferry to the island",
    "buy bread from the corner bakery", "watch the puppet theatre",
    "row a boat across the lake", "hike to the waterfall", "tour the tram depot",
    "taste the local honey", "read in the public library", "paint the lighthouse",
    "photograph the fishing boats", "sleep under the stars in the desert",
)  # fmt: skip
WINDOW, SINK_KEYS, FEATURES = 16, 4, 256
#: The tasks, in the order their documents are drawn.
TASKS = ("passkey", "needle", "fidelity")
CHUNK = 512


def prose_sentences() -> list[str]:
    """Plain sentences of the Python reference manual (``pydoc_data.topics``): no code,
    no markup, 8 to 40 words each."""
    from pydoc_data.topics import topics

    text = re.sub(r"\s+", " ", " ".join(topics.values()))
    chosen = []
    for sentence in re.split(r"(?<=[.!?])\s+", text):
        sentence = sentence.strip()
        if not (
            8 <= len(sentence.split()) <= 40 and sentence.isascii() and sentence[:1].isupper()
        ):
            continue
        if re.search(r"[{}\[\]<>=*_`|#~^\\]|\.\.\.|[a-z]\.[a-z]", sentence):
            continue
        chosen.append(sentence)
    return chosen


class Builder:
    """Documents of an exact token count from the model's tokenizer."""

    def __init__(self, tokenizer: Any, seed: int) -> None:
        self.tokenizer = tokenizer
        self.rng = np.random.default_rng(seed)
        self.prose = [self.ids(s) for s in prose_sentences()]
        self.filler = self.ids(PASSKEY_FILLER)
        self.cls, self.sep = self.ids_special("[CLS]"), self.ids_special("[SEP]")

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def ids_special(self, token: str) -> int:
        return int(self.tokenizer.token_to_id(token))

    def _filler(self, kind: str, count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count:
            if kind == "passkey":
                out += self.filler
            else:
                out += self.prose[int(self.rng.integers(len(self.prose)))]
        return out[:count]

    def document(self, kind: str, length: int, depth: float, key: str | None) -> np.ndarray:
        """``[CLS] filler key filler [SEP]``, ``length`` tokens, the key sentence starting
        at ``depth`` of the inner tokens (no key: prose only)."""
        inner = length - 2
        key_ids = self.ids(key) if key else []
        if len(key_ids) > inner:
            raise ValueError(f"length {length} is too short for the key sentence {key!r}")
        before = round(depth * (inner - len(key_ids)))
        after = inner - len(key_ids) - before
        body = self._filler(kind, before) + key_ids + self._filler(kind, after)
        return np.array([self.cls, *body, self.sep], dtype=np.int64)


def task(
    builder: Builder, kind: str, length: int, count: int
) -> tuple[list[np.ndarray], list[str]]:
    """``count`` documents of ``length`` tokens and their queries (query i: document i)."""
    rng = builder.rng
    depths = np.linspace(0.0, 1.0, count) if count > 1 else np.array([0.5])
    docs, queries = [], []
    if kind == "passkey":
        names = rng.choice(NAMES, size=count, replace=False)
        for name, depth in zip(names, depths, strict=True):
            key = str(int(rng.integers(10_000, 100_000)))
            sentence = (
                f"{name}'s pass key is {key}. Remember it. {key} is the pass key for {name}."
            )
            docs.append(builder.document(kind, length, float(depth), sentence))
            queries.append(f"what is the pass key for {name}?")
    else:
        cities = rng.choice(CITIES, size=count, replace=False)
        activities = rng.choice(ACTIVITIES, size=count, replace=False)
        for city, activity, depth in zip(cities, activities, depths, strict=True):
            sentence = f"The best thing to do in {city} is {activity}."
            docs.append(builder.document(kind, length, float(depth), sentence))
            queries.append(f"What is the best thing to do in {city}?")
    return docs, queries


# -- configurations ------------------------------------------------------------------------


def attentions(args: argparse.Namespace, encoder: Any) -> dict[str, Callable[..., np.ndarray]]:
    """Each configuration's attention callable on ``encoder`` (extended already)."""
    import linattn as la
    from linattn.models.bert import exact_attention
    from linattn.models.convert import FittedAttention
    from linattn.transfer import exact_heads_of, load_maps

    layers, d = encoder.config.num_layers, encoder.config.head_dim
    out: dict[str, Callable[..., np.ndarray]] = {
        "exact": exact_attention,
        "window": FittedAttention([None] * layers, WINDOW, SINK_KEYS, True),
    }
    maps = [la.FeatureMap(d, FEATURES, kind="hyperbolic", seed=layer) for layer in range(layers)]
    out["hybrid"] = FittedAttention(list(maps), WINDOW, SINK_KEYS, True)
    for name, folder in (("fitted-512", args.fitted_512), ("fitted-2k", args.fitted_2k)):
        if folder is None:
            continue
        path = Path(folder)
        path = path / "fitted.safetensors" if path.is_dir() else path
        layers_maps, options = load_maps(path, model_fingerprint=None)
        out[name] = FittedAttention(
            [fm for fm, _ in layers_maps], options["window"], options["sink_keys"], True,
            exact_heads_of(options, len(layers_maps)),  # (a file converted with exact heads)
        )  # fmt: skip
    return out


def _encode(encoder: Any, ids: np.ndarray, attention: Callable[..., np.ndarray]) -> np.ndarray:
    mask = np.ones((1, ids.shape[-1]), dtype=bool)
    return encoder.encode(ids[None], mask, attention)[0]


def _chunked(original: Any, ids: np.ndarray) -> np.ndarray:
    """The original model on 512-token pieces, their embeddings averaged."""
    inner = ids[1:-1]
    pieces = [inner[i : i + CHUNK - 2] for i in range(0, len(inner), CHUNK - 2)]
    embeddings = [_encode(original, np.array([ids[0], *p, ids[-1]]), _exact()) for p in pieces]
    mean = np.mean(embeddings, axis=0)
    return mean / np.linalg.norm(mean)


def _exact() -> Callable[..., np.ndarray]:
    from linattn.models.bert import exact_attention

    return exact_attention


def run_length(args: argparse.Namespace, length: int, out: dict[str, Any]) -> None:
    from linattn.models import load_model
    from linattn.models.positions import extend_positions

    original = load_model("minilm")
    model = load_model("minilm")
    if length > model.encoder.max_length:
        extend_positions(model.encoder, length, args.positions)
    builder = Builder(model.tokenizer, args.seed + length)
    configs = attentions(args, model.encoder)
    names = [*configs, "chunks"]
    if length > args.exact_up_to:
        names.remove("exact")
    if args.only:
        names = [n for n in names if n in args.only]
    row: dict[str, Any] = {"length": length, "count": args.count}
    embeddings: dict[str, dict[str, list[np.ndarray]]] = {}
    for kind in TASKS:  # every task's documents drawn, in order: the same for any --tasks
        if kind == "fidelity":
            docs = [builder.document("needle", length, 0.0, None) for _ in range(args.count)]
            queries: list[str] = []
        else:
            docs, queries = task(builder, kind, length, args.count)
        if kind not in args.tasks:
            continue
        query_ids = [np.array([builder.cls, *builder.ids(q), builder.sep]) for q in queries]
        embeddings[kind] = {}
        for name in names:
            encode = (
                (lambda ids: _chunked(original.encoder, ids))
                if name == "chunks"
                else (lambda ids, a=configs[name]: _encode(model.encoder, ids, a))
            )
            seconds, peaks, doc_embeddings = [], [], []
            for ids in docs:
                _reset_peak()
                before = _rss()
                start = time.perf_counter()
                doc_embeddings.append(encode(ids))
                seconds.append(time.perf_counter() - start)
                peaks.append(max(0, _peak() - before))
            embeddings[kind][name] = doc_embeddings
            result = row.setdefault(name, {})
            result[f"{kind}_seconds"] = float(np.mean(seconds))
            result["peak_mib"] = max(result.get("peak_mib", 0.0), max(peaks) / 2**20)
            if queries:
                query_encoder = original.encoder if name == "chunks" else model.encoder
                q = np.stack([_encode(query_encoder, ids, _exact()) for ids in query_ids])
                scores = q @ np.stack(doc_embeddings).T
                result[f"{kind}_ndcg1"] = float(
                    np.mean(np.argmax(scores, axis=1) == np.arange(len(q)))
                )
            said = {key: round(value, 4) for key, value in result.items() if key.startswith(kind)}
            print(f"  L={length} {name}: {said}", file=sys.stderr, flush=True)
    reference = embeddings.get("fidelity", {}).get("exact")
    if reference is not None:
        for name in names:
            cosines = [
                float(a @ b) for a, b in zip(embeddings["fidelity"][name], reference, strict=True)
            ]
            row[name]["cosine_mean"], row[name]["cosine_min"] = (
                float(np.mean(cosines)),
                float(np.min(cosines)),
            )
    out["rows"].append(row)


def plot(out: dict[str, Any], path: Path) -> None:
    """nDCG@1 of each task and time per document against the length, one line per
    configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = out["rows"]
    names = sorted({n for row in rows for n in row if isinstance(row[n], dict)})
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name in names:
        for axis, key in zip(
            axes, ("passkey_ndcg1", "needle_ndcg1", "passkey_seconds"), strict=True
        ):
            points = [(r["length"], r[name][key]) for r in rows if key in r.get(name, {})]
            if points:
                axis.plot(*zip(*points, strict=True), marker="o", label=name)
    for axis, title in zip(
        axes, ("passkey nDCG@1", "needle nDCG@1", "seconds per document"), strict=True
    ):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("tokens")
        axis.set_title(title)
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


#: The configurations, in the table's order.  (Named NAMES, this tuple shadowed the
#: passkey's names above from 3a20768 on: the passkey asked for "exact"'s key.)
CONFIGURATIONS = ("exact", "chunks", "window", "hybrid", "fitted-512", "fitted-2k")


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of ``docs/long-documents.md``: per length and configuration,
    nDCG@1 of both tasks, the fidelity cosines, seconds per document, peak memory."""
    lines = [
        "| L | configuration | passkey nDCG@1 | needle nDCG@1 | cosine mean | cosine min "
        "| s / document | peak MiB |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in sorted(rows, key=lambda r: r["length"]):
        for name in CONFIGURATIONS:
            if name not in row:
                continue
            r = row[name]

            def cell(key: str, digits: int = 2, r: dict[str, Any] = r) -> str:
                return f"{r[key]:.{digits}f}" if key in r else "-"

            lines.append(
                f"| {row['length']:,} | {name} | {cell('passkey_ndcg1')} | "
                f"{cell('needle_ndcg1')} | {cell('cosine_mean', 3)} | {cell('cosine_min', 3)} "
                f"| {cell('passkey_seconds')} | {r.get('peak_mib', 0):.0f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--count", type=int, default=6, help="documents per task and length")
    parser.add_argument("--fitted-512", default=None, metavar="DIR")
    parser.add_argument("--fitted-2k", default=None, metavar="DIR")
    parser.add_argument("--exact-up-to", type=int, default=8192)
    parser.add_argument("--positions", choices=METHODS, default="interpolate")
    parser.add_argument("--only", nargs="+", default=None, help="these configurations only")
    parser.add_argument(
        "--tasks", nargs="+", choices=TASKS, default=list(TASKS),
        help="fidelity needs exact attention: it is wasted beyond --exact-up-to",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, metavar="PNG")
    parser.add_argument(
        "--replot",
        type=Path,
        nargs="+",
        default=None,
        metavar="JSON",
        help="only draw --plot and print the table from JSON files this script wrote",
    )
    args = parser.parse_args()
    if args.replot is not None:  # (several files: their rows together)
        out = {"rows": [r for f in args.replot for r in json.loads(f.read_text())["rows"]]}
        plot(out, args.plot or args.replot[0].with_suffix(".png"))
        print(table(out["rows"]))
        return
    out: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": []}
    for length in args.lengths:
        start = time.perf_counter()
        run_length(args, length, out)
        out["rows"][-1]["seconds"] = time.perf_counter() - start
        print(json.dumps(out["rows"][-1]), flush=True)
        if args.json is not None:
            args.json.write_text(json.dumps(out, indent=1))
        if args.plot is not None:
            plot(out, args.plot)


if __name__ == "__main__":
    os.environ.setdefault("LINATTN_COMPILE", "foreground")
    main()
