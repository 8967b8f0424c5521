"""``linattn convert --model-out DIR``: the converted model as one complete folder.

The folder is a sentence-transformers model (the encoder, its tokenizer, mean pooling
over real tokens and L2 normalisation: the embeddings ``linattn accuracy`` measures)
with the fitted maps inside (``linattn-maps.safetensors``, named relative to the
folder) and ``"attn_implementation": "linattn"`` in its ``config.json``
(:func:`linattn.integrations.transformers.save_pretrained`).  After ``import
linattn.integrations.transformers`` both ``SentenceTransformer(DIR)`` and
``transformers.AutoModel.from_pretrained(DIR)`` load it; without that import
transformers refuses it rather than running exact attention.  A conversion at length
(``--max-length`` above the model's positions) saves the extended position table and
``max_seq_length`` raised to match.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
from pathlib import Path

from linattn.cli._options import CommandError

__all__ = ["check_model_out", "write_model_folder"]

#: What the folder needs, and what installs it (torch first, its CPU build: README).
NEEDS = ("torch", "transformers", "sentence_transformers")
INSTALL = "pip install torch 'linattn[transformers]' sentence-transformers"


def check_model_out(path: Path | None) -> None:
    """``--model-out``'s errors, before any work: a file in its place, or a library
    missing to write the folder.

    Examples
    --------
    >>> check_model_out(None)  # (no folder asked for: nothing to check)
    """
    if path is None:
        return
    if path.exists() and not path.is_dir():
        raise CommandError(f"--model-out {path}: must be a folder (the model's); got a file")
    missing = [name for name in NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        raise CommandError(
            f"--model-out writes a transformers / sentence-transformers folder, which needs "
            f"{', '.join(missing)}: {INSTALL}"
        )


def write_model_folder(source: Path, fitted: Path, out: Path, max_length: int) -> Path:
    """Write the model of folder ``source`` with the maps of ``fitted`` to ``out``
    (its positions extended as the maps' file records; a folder already there is
    replaced whole, once the new one is complete); returns ``out``."""
    from sentence_transformers import SentenceTransformer

    try:  # (sentence-transformers 6; the old name warns there)
        models = importlib.import_module("sentence_transformers.sentence_transformer.modules")
    except ImportError:
        models = importlib.import_module("sentence_transformers.models")
    from linattn.integrations.transformers import load_fitted, save_pretrained
    from linattn.models.positions import POSITIONS_ENTRY, extend_positions
    from linattn.transfer import load_maps

    _, options = load_maps(fitted, model_fingerprint=None, partial=True)
    transformer = models.Transformer(str(source), max_seq_length=max_length)
    width = int(transformer.auto_model.config.hidden_size)
    pooling = models.Pooling(width, pooling_mode="mean")
    model = SentenceTransformer(modules=[transformer, pooling, models.Normalize()], device="cpu")
    extension = options.get(POSITIONS_ENTRY)
    if extension:
        extend_positions(model[0].auto_model, int(extension["length"]), str(extension["method"]))
    load_fitted(model[0].auto_model, fitted)
    # Written beside it and renamed into place: an interrupted write leaves no folder
    # that would load (a config without the linattn entries loads as the exact model).
    partial = out.with_name(f"{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        save_pretrained(model, partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if out.exists():
        old = out.with_name(f"{out.name}.old-{os.getpid()}")
        out.rename(old)
        partial.rename(out)
        shutil.rmtree(old)
    else:
        partial.rename(out)
    return out
