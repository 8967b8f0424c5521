"""``linattn convert --model PATH|minilm --texts FILE --out DIR``: fit a model's attention.

Every attention layer of the BERT sentence encoder gets per-head fitted maps and far
weights (:func:`linattn.models.convert.convert_encoder`) on the user's texts, one per
line: every ``--validation-every``-th text goes to the validation split (early
stopping, ``g = 0`` per head), the rest to the fit split.  Writes
``DIR/fitted.safetensors`` (loaded by ``linattn accuracy --model ... --fitted DIR`` and
:func:`linattn.models.convert.attention_from_file`) and ``DIR/report.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from linattn.cli._console import Console, Table
from linattn.cli._options import CommandError

__all__ = ["FITTED_FILE", "convert", "read_texts"]

#: The maps' file inside ``--out``.
FITTED_FILE = "fitted.safetensors"


def read_texts(path: Path) -> list[str]:
    """Non-empty lines of ``path``; a clear error for a missing or empty file."""
    try:
        lines = Path(path).read_text("utf-8").splitlines()
    except OSError as error:
        raise CommandError(f"--texts {path}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise CommandError(
            f"--texts {path}: must be UTF-8 text; byte {error.start} is not ({error.reason})"
        ) from None
    texts = [line.strip() for line in lines if line.strip()]
    if len(texts) < 2:
        raise CommandError(
            f"--texts {path}: needs at least 2 non-empty lines (fit and validation texts); "
            f"got {len(texts)}"
        )
    return texts


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
    try:
        model = load_model(args.model)
    except (ModelUnavailable, ValueError) as error:
        raise CommandError(f"--model {args.model}: {error}") from None
    tokens = model.tokenize(texts)
    index = np.arange(len(texts))
    validation = index % args.validation_every == args.validation_every - 1
    console = Console()
    console.print(
        f"fitting {model.encoder.config.num_layers} layers: {int((~validation).sum())} fit "
        f"texts, {int(validation.sum())} validation texts, window {args.window} + "
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
            progress=lambda line: console.print(line),
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
    table = Table("Relative attention error on the validation texts (root mean square over heads)")
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
            f"{np.sqrt(np.mean(fit.validation_error**2)):.3f}",
            f"{np.sqrt(np.mean(fit.exact_parts_error**2)):.3f}",
            str(int(fit.exact_only.sum())),
            f"{worst} ({shares[worst]:.0%})",
            " ".join(map(str, exact)) or "-",
            str(fit.steps),
            f"{fit.seconds:.0f}",
        )
    console.print(table)
    console.print(f"wrote: {path} ({seconds:.0f} s)")
    return 0
