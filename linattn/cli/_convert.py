"""``linattn convert --model PATH|minilm --texts FILE --out DIR``: fit a model's attention.

Every attention layer of the BERT sentence encoder gets per-head fitted maps and far
weights (:func:`linattn.models.convert.convert_encoder`) on the user's texts, one per
line: every ``--validation-every``-th text goes to the validation split (early
stopping, ``g = 0`` per head), the rest to the fit split.  Writes
``DIR/fitted.safetensors`` (loaded by ``linattn accuracy --model ... --fitted DIR`` and
:func:`linattn.models.convert.attention_from_file`) and ``DIR/report.json``; with
``--model-out`` also the converted model as one folder (:mod:`linattn.cli._model_folder`).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

import numpy as np

from linattn.cli._console import Console, Table
from linattn.cli._memory import keep_freed_memory
from linattn.cli._model_folder import check_model_out, write_model_folder
from linattn.cli._options import CommandError

__all__ = ["FITTED_FILE", "convert", "packed", "read_texts"]

#: The maps' file inside ``--out``.
FITTED_FILE = "fitted.safetensors"


def read_texts(path: Path, least: int = 2) -> list[str]:
    """Non-empty lines of ``path`` (at least ``least``: 2 for a conversion's fit and
    validation texts); a clear error for a missing or empty file."""
    try:
        lines = Path(path).read_text("utf-8").splitlines()
    except OSError as error:
        raise CommandError(f"--texts {path}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise CommandError(
            f"--texts {path}: must be UTF-8 text; byte {error.start} is not ({error.reason})"
        ) from None
    texts = [line.strip() for line in lines if line.strip()]
    if len(texts) < least:
        why = " (fit and validation texts)" if least == 2 else ""
        raise CommandError(
            f"--texts {path}: needs at least {least} non-empty line{'s' * (least > 1)}{why}; "
            f"got {len(texts)}"
        )
    return texts


#: Query rows per long calibration batch when ``--query-rows`` is not given (inputs of
#: more than :data:`LONG` tokens): ``256 x L`` weights per head instead of ``L x L``.
QUERY_ROWS = 256
LONG = 512
#: The longest ``--max-length``: 64 times the model's own positions (interpolated
#: positions closer than 1/64 of a learned step were not measured).
MAX_STRETCH = 64


def _check_lengths(args: argparse.Namespace) -> None:
    """``--max-length`` against the exact parts, before anything loads."""
    from linattn.models.minilm import MAX_LENGTH

    length = MAX_LENGTH if args.max_length is None else args.max_length
    least = args.window + args.sink_keys + 2
    if length < least:
        raise CommandError(
            f"--max-length must be at least --window + --sink-keys + 2 = {least} (shorter "
            f"texts have no far keys to fit); got {length}"
        )
    if args.pack and args.max_length is None:
        raise CommandError("--pack joins texts up to --max-length tokens: give --max-length")


def _extend(model: Any, length: int, method: str) -> str | None:
    """Extend the model's positions to ``length`` where it has fewer; what was done."""
    from linattn.models.positions import extend_positions

    have = model.encoder.max_length
    if length <= have:
        return None
    if length > MAX_STRETCH * have:
        raise CommandError(
            f"--max-length must be at most {MAX_STRETCH} x the model's {have} positions = "
            f"{MAX_STRETCH * have} (--positions {method}); got {length}"
        )
    extend_positions(model.encoder, length, method)
    return f"positions extended from {have} to {length} ({method})"


def packed(tokenizer_lengths: list[int], limit: int) -> list[list[int]]:
    """Consecutive texts grouped so that each group's tokens (less one ``[CLS]`` and
    ``[SEP]`` per text joined) stay within ``limit``; a text longer than ``limit`` is a
    group of its own (cut when tokenized).

    Examples
    --------
    >>> packed([10, 10, 10, 30], 25)
    [[0, 1], [2], [3]]
    """
    groups: list[list[int]] = []
    size = 0
    for i, n in enumerate(tokenizer_lengths):
        inner = n - 2  # the text without its own [CLS] and [SEP]
        if groups and size + inner <= limit:
            groups[-1].append(i)
            size += inner
        else:
            groups.append([i])
            size = n
    return groups


def pooled(errors: np.ndarray, norms: np.ndarray) -> float:
    """A layer's relative error ``||out - exact|| / ||exact||`` over all its heads from
    the heads' relative errors and exact squared norms: the figure the fit's progress
    lines give ("validation error").

    Examples
    --------
    >>> round(pooled(np.array([0.1, 0.3]), np.array([3.0, 1.0])), 4)
    0.1732
    """
    return float(np.sqrt(np.sum(errors**2 * norms) / np.sum(norms)))


class _Progress:
    """The fit's progress lines on standard error, with the elapsed time and, from the
    ``"layer l: step s/S"`` lines, an estimate of the time left."""

    def __init__(self, layers: int) -> None:
        self.console = Console(stderr=True)
        self.layers = layers
        self.start = time.perf_counter()

    def __call__(self, line: str) -> None:
        elapsed = time.perf_counter() - self.start
        said = f"[{_clock(elapsed)}"
        found = re.match(r"layer (\d+): step (\d+)/(\d+)", line)
        if found:
            layer, step, steps = (int(g) for g in found.groups())
            done = (layer + step / steps) / self.layers
            if 0 < done < 1:
                said += f", about {_clock(elapsed * (1 - done) / done)} left"
        self.console.print(f"{said}] {line}")


def _clock(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}:{rest:02d}"


def convert(args: argparse.Namespace) -> int:
    """Fit, save, and print a per-layer table (validation errors)."""
    from linattn.models import ModelUnavailable, load_model
    from linattn.models.convert import convert_encoder, length_batches, save_fitted

    texts = read_texts(args.texts)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CommandError(f"--out {out}: must be a folder (it holds {FITTED_FILE}); got a file")
    if args.num_features < 2 or args.num_features % 2:
        raise CommandError(
            "--num-features must be an even integer of at least 2 (a fitted map's features "
            f"come in pairs); got {args.num_features}"
        )
    _check_lengths(args)
    check_model_out(args.model_out)
    keep_freed_memory()  # (steps reuse their pages: the kernel zeroed each one afresh)
    try:
        model = load_model(args.model)
    except (ModelUnavailable, ValueError) as error:
        raise CommandError(f"--model {args.model}: {error}") from None
    console = Console()
    if args.max_length is not None:
        said = _extend(model, args.max_length, args.positions)
        model.max_length = args.max_length
        if said:
            console.print(said)
    index = np.arange(len(texts))
    validation = index % args.validation_every == args.validation_every - 1
    if args.pack:  # each split's texts joined apart: no document holds both
        lengths = [int(n) for n in model.tokenize(texts).full_lengths]
        docs, held = [], []
        for split in (False, True):
            chosen = index[validation == split]
            for group in packed([lengths[i] for i in chosen], model.max_length):
                docs.append(" ".join(texts[chosen[i]] for i in group))
                held.append(split)
        console.print(
            f"packed {len(texts)} texts into {len(docs)} documents of up to "
            f"{model.max_length} tokens"
        )
        texts, validation, index = docs, np.array(held), np.arange(len(docs))
    unit = "documents" if args.pack else "texts"
    tokens = model.tokenize(texts)
    least = max(args.window, args.sink_keys) + 2  # (the shortest text with a far key)
    short = int(np.sum(tokens.lengths < least))
    if short:
        console.print(
            f"warning: {short} of {len(texts)} calibration {unit} have fewer than {least} "
            f"tokens (max(--window, --sink-keys) + 2): none of their keys is far, so they "
            f"teach the fit nothing ({len(texts) - short} useful); longer texts, or --pack "
            "with --max-length, give it far keys"
        )
    query_rows = args.query_rows
    if query_rows is None and int(tokens.input_ids.shape[1]) > LONG:
        query_rows = QUERY_ROWS
    console.print(
        f"fitting {model.encoder.config.num_layers} layers: {int((~validation).sum())} fit "
        f"{unit}, {int(validation.sum())} validation {unit}, window {args.window} + "
        f"{args.sink_keys} sink keys, "
        f"m = {args.num_features}, at most {args.steps} steps per layer"
    )
    start = time.perf_counter()
    try:
        done = convert_encoder(
            model.encoder,
            length_batches(tokens.input_ids, tokens.key_mask, index[~validation], args.batch_size),
            length_batches(tokens.input_ids, tokens.key_mask, index[validation], args.batch_size),
            window=args.window,
            sink_keys=args.sink_keys,
            num_features=args.num_features,
            steps=args.steps,
            seed=args.seed,
            exact_heads=args.exact_heads,
            query_rows=query_rows,
            progress=_Progress(model.encoder.config.num_layers),
            checkpoint=out / FITTED_FILE,
        )
    except ValueError as error:  # (an option or a checkpoint the conversion refuses)
        raise CommandError(str(error)) from None
    seconds = time.perf_counter() - start
    path = save_fitted(out / FITTED_FILE, done)
    report = {
        "model": str(model.path),
        "texts": str(args.texts),
        "fit_texts": int((~validation).sum()),
        "validation_texts": int(validation.sum()),
        "seconds": seconds,
        "options": done.options,
        "layers": [
            {
                "validation_error": f.validation_error.tolist(),
                "window_sinks_error": f.exact_parts_error.tolist(),
                "exact_only_heads": int(f.exact_only.sum()),
                "exact_heads": list(heads),
                "error_shares": f.error_shares().tolist(),
                "steps": f.steps,
                "seconds": f.seconds,
            }
            if f is not None
            else {"resumed": True}
            for f, heads in zip(done.fits, done.attention.exact_heads, strict=True)
        ],
    }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    table = Table(
        f"Validation error per layer, ||out - exact|| / ||exact|| over all heads, on the "
        f"validation {unit} (the progress lines' figure)"
    )
    headers = (
        "layer",
        "fitted",
        "window + sinks",
        "heads with g = 0",
        "worst head (share)",
        "exact heads",
        "steps",
        "s",
    )
    for header in headers:
        table.add_column(header, right=header != "layer")
    for layer, (fit, exact) in enumerate(zip(done.fits, done.attention.exact_heads, strict=True)):
        if fit is None:
            table.add_row(str(layer), "resumed", *[""] * (len(headers) - 2))
            continue
        shares = fit.error_shares()
        worst = int(np.argmax(shares))
        table.add_row(
            str(layer),
            f"{pooled(fit.validation_error, fit.exact_squared_norm):.3f}",
            f"{pooled(fit.exact_parts_error, fit.exact_squared_norm):.3f}",
            str(int(fit.exact_only.sum())),
            f"{worst} ({shares[worst]:.0%})",
            " ".join(map(str, exact)) or "-",
            str(fit.steps),
            f"{fit.seconds:.0f}",
        )
    console.print(table)
    console.print(f"wrote: {path} ({seconds:.0f} s)")
    if args.model_out is not None:
        folder = write_model_folder(model.path, path, args.model_out, model.max_length)
        console.print(
            f"wrote the model folder: {folder} (import linattn.integrations.transformers, "
            f"then SentenceTransformer({str(folder)!r}) or AutoModel.from_pretrained)"
        )
    return 0
