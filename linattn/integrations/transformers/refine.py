"""Refine a converted model's fitted maps end to end (stitching (c)), weights frozen.

:func:`linattn.integrations.transformers.convert` fits each attention layer to its own
exact output; the layers' remaining errors then compound through the model.
:func:`refine` takes the converted model and fits every layer's maps and far weights
*together* to the exact model's final hidden states: Adam on the squared error of the
last hidden state over real tokens (or ``1 - cos`` of the mean-pooled sentence
embeddings), the model's weights frozen (only the maps' parameters get gradients;
``torch.autograd.grad`` leaves every ``.grad`` of the model as it was), the step kept
that gives the lowest error on the validation batches.

During the fit each attention call runs :func:`linattn.torch.fitted_attention` on the
maps' parameters as tensors (the dense form of the hybrid at training lengths, the
library's path beyond: :func:`linattn._fitted_call.use_dense` chooses), so autograd
carries the gradient from the last layer back to every map; afterwards the model runs
the library's own path with the refined maps.  Measured on all-MiniLM-L6-v2
(``benchmarks/transfer_end_to_end.py``; figures in ``docs/estimators.md``).
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from linattn import fitted
from linattn.features import FeatureMap
from linattn.integrations.transformers.attention import splice_exact_heads
from linattn.integrations.transformers.capture import (
    AttentionCall,
    check_batches,
    exact_attention,
    hooked,
    model_device,
)
from linattn.integrations.transformers.convert import restore_state, save_state
from linattn.integrations.transformers.options import Model, use_linattn
from linattn.integrations.transformers.order import SinksFirst
from linattn.integrations.transformers.state import state_of, update
from linattn.torch import fitted_attention

__all__ = ["LOSSES", "refine"]


@dataclass
class _Layer:
    """One layer's trainable parameters (torch leaves) and what stays fixed."""

    module: torch.nn.Module
    feature_map: FeatureMap
    values: dict[str, torch.Tensor]  # query_weight, query_bias[, key_*], log_far_weight
    far_on: torch.Tensor  # (H_kv,) or (): heads whose g > 0 (g = 0 stays exactly 0)

    def log_far_weight(self) -> torch.Tensor:
        zero = torch.full_like(self.values["log_far_weight"], fitted.ZERO_FAR_LOG)
        return torch.where(self.far_on, self.values["log_far_weight"], zero)

    def feature_map_now(self) -> FeatureMap:
        """The map with the current values (``g = 0`` heads kept at 0)."""
        host = {n: t.detach().cpu().double().numpy() for n, t in self.values.items()}
        far = np.where(self.far_on.cpu().numpy(), np.exp(host.pop("log_far_weight")), 0.0)
        return self.feature_map.with_parameters(**host, far_weight=far)


def _layer(module: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> _Layer:
    fm = state_of(module).fitted
    assert fm is not None  # refine takes the modules with a fitted map
    p = fm.parameters
    assert p is not None  # convert stores fitted maps only
    values = {
        name: torch.tensor(np.array(value), dtype=dtype, device=device, requires_grad=True)
        for name, value in p.arrays().items()
        if name != "far_weight"
    }
    log_g = fitted.log_far_weight(p)
    values["log_far_weight"] = torch.tensor(log_g, dtype=dtype, device=device, requires_grad=True)
    far_on = torch.tensor(np.asarray(p.far_weight) > 0, device=device)
    return _Layer(module, fm, values, far_on)


class _Hook:
    """The integration's capture hook: each attention call exact, or the dense hybrid."""

    def __init__(self, layers: dict[int, _Layer] | None, settings: Mapping[str, Any]) -> None:
        self.layers = layers
        self.window = settings.get("window")
        self.sink_keys = int(settings.get("sink_keys") or 0)

    def __call__(self, call: AttentionCall) -> torch.Tensor:
        if self.layers is None:
            return exact_attention(call)
        layer = self.layers.get(id(call.module))
        if layer is None:
            raise ValueError(
                f"an attention module ({type(call.module).__name__}) without a fitted map ran: "
                "refine needs every attention layer converted"
            )
        if call.query.shape[-2] != call.key.shape[-2]:
            raise ValueError(
                f"refine fits self-attention: got {call.query.shape[-2]} queries against "
                f"{call.key.shape[-2]} keys (cross-attention or a cache)"
            )
        values = {name: t for name, t in layer.values.items() if name != "log_far_weight"}
        dtype = values["query_weight"].dtype
        q, k, v = call.query.to(dtype), call.key.to(dtype), call.value.to(dtype)
        key_mask, exact = call.key_mask, call.exact_key_mask
        reorder = SinksFirst.of(key_mask, self.sink_keys, call.causal)  # as attention runs
        if reorder is not None:
            assert key_mask is not None  # (a reordering needs one)
            q, k, v, key_mask, exact = reorder.take_call(q, k, v, key_mask, exact)
        out = fitted_attention(
            q, k, v, values.pop("query_weight"), **values,
            far_weight=layer.log_far_weight().exp(), tied="key_weight" not in values,
            causal=call.causal, key_mask=key_mask, exact_key_mask=exact, window=self.window,
            sink_keys=self.sink_keys, scale=call.scaling,
        )  # fmt: skip
        if reorder is not None:
            out = reorder.restore(out)
        out = splice_exact_heads(
            call.module, out, call.query.to(dtype), call.key.to(dtype), call.value.to(dtype),
            call.key_mask, call.causal, call.scaling,
        )  # fmt: skip
        return out.transpose(1, 2).to(call.query.dtype)  # transformers' (B, L, H, d_v)


def _hidden(model: Model, batch: Mapping[str, Any], hook: _Hook) -> torch.Tensor:
    """The last hidden state of ``batch`` with every attention call through ``hook``."""
    device = model_device(model)
    inputs = {n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in batch.items()}
    if "use_cache" in inspect.signature(model.forward).parameters:
        inputs["use_cache"] = False
    with hooked(hook):
        out = model(**inputs, output_hidden_states=True)
    hidden: torch.Tensor = out.hidden_states[-1]
    return hidden


def _hidden_error(
    hidden: torch.Tensor, exact: torch.Tensor, batch: Mapping[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over real tokens of ``|h - h_exact|^2``, and of ``|h_exact|^2``."""
    rows = batch["attention_mask"].to(hidden.device).bool()[..., None]
    diff = (hidden.to(exact.dtype) - exact) * rows
    return (diff**2).sum(), ((exact * rows) ** 2).sum()


def _pooled_error(
    hidden: torch.Tensor, exact: torch.Tensor, batch: Mapping[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over rows of ``1 - cos`` of the mean-pooled embeddings, and the row count."""
    rows = batch["attention_mask"].to(hidden.device)[..., None].to(exact.dtype)
    pooled = (hidden.to(exact.dtype) * rows).sum(-2), (exact * rows).sum(-2)
    cos = torch.nn.functional.cosine_similarity(*pooled, dim=-1)
    return (1 - cos).sum(), torch.tensor(float(cos.shape[0]), dtype=exact.dtype)


#: ``refine``'s losses: (error sum, normaliser) of a batch; the fit minimises their
#: ratio, the validation error is ``sqrt(sum of errors / sum of normalisers)``.
LOSSES = {"hidden": _hidden_error, "pooled": _pooled_error}


def refine(
    model: Model,
    batches: Iterable[Mapping[str, Any]],
    validation: Iterable[Mapping[str, Any]],
    *,
    steps: int = 60,
    learning_rate: float = 1e-3,
    evaluate_every: int = 10,
    loss: str = "hidden",
    progress: Callable[[str], None] | None = None,
) -> Model:
    """Fit a converted model's maps and far weights together, to its exact final states.

    Stitching (c) of ``docs/algorithm.md`` (section "Fitted feature maps"): after
    :func:`linattn.integrations.transformers.convert`, a short Adam fit of only the
    maps' parameters and far weights (``log g``; heads the conversion set to ``g = 0``
    stay at 0) on the error of the model's last hidden state against the exact model's
    (``loss``), over real tokens of ``batches``.  Every ``evaluate_every`` steps the same
    error on ``validation`` is measured (``"hidden"``: ``||h - h_exact|| / ||h_exact||``);
    the parameters of the lowest (step 0, the conversion's, included) are kept.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A model converted by ``convert`` (or given maps by ``load_fitted``).  Its weights
        and their ``.grad`` are not changed.
    batches, validation : iterable of dict
        Tokenizer output from disjoint texts, as ``convert``'s (they may be the same
        splits as the conversion's).  Every batch is held in memory with the exact
        model's last hidden states.
    steps : int, default 60
        Gradient steps (one batch each, in turn).
    learning_rate : float, default 1e-3
        Adam's step size (the per-layer fit's is 1e-2: this one starts near a minimum).
    evaluate_every : int, default 10
    loss : {"hidden", "pooled"}
        What is fitted and validated: ``"hidden"``, the squared error of the last hidden
        state over real tokens, relative to the exact one's squared norm (any model);
        ``"pooled"``, ``1 - cos`` of the mean-pooled last hidden states, the sentence
        embeddings of models such as all-MiniLM-L6-v2 (validation error ``sqrt`` of its
        mean).
    progress : callable, optional
        Called with one line per evaluation (step 0 included).

    Returns
    -------
    model
        The same model running ``attn_implementation="linattn"`` with the refined maps;
        the conversion record that
        :func:`linattn.integrations.transformers.save_fitted` writes gains
        ``"refine"`` (steps, the step kept, validation errors).

    Raises
    ------
    ValueError
        A model without fitted maps, a batch without ``input_ids``/``attention_mask`` or
        real tokens, ``steps`` or ``evaluate_every`` below 0 / 1, an unknown ``loss``.
        The model is left as it was.

    Examples
    --------
    >>> import torch, transformers
    >>> from linattn.integrations.transformers import convert, refine
    >>> torch.manual_seed(0) and None
    >>> config = transformers.BertConfig(num_hidden_layers=1, hidden_size=16,
    ...     num_attention_heads=2, intermediate_size=32, vocab_size=30)
    >>> model = transformers.BertModel(config, add_pooling_layer=False).eval()
    >>> def batch(seed):
    ...     ids = torch.randint(0, 30, (2, 12), generator=torch.Generator().manual_seed(seed))
    ...     return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    >>> model = convert(model, [batch(1)], [batch(2)], window=2, num_features=4, steps=4)
    >>> model = refine(model, [batch(1)], [batch(2)], steps=2, evaluate_every=1)
    >>> sorted(model._linattn_conversion["refine"])
    ['kept_step', 'learning_rate', 'loss', 'seconds', 'steps', 'validation_error']
    """
    if steps < 0 or evaluate_every < 1:
        raise ValueError(
            f"steps must be >= 0 and evaluate_every >= 1; got steps={steps}, "
            f"evaluate_every={evaluate_every}"
        )
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {sorted(LOSSES)}; got {loss!r}")
    error_of = LOSSES[loss]
    fit_inputs = check_batches(batches, "batches")
    val_inputs = check_batches(validation, "validation")
    modules = [m for m in model.modules() if state_of(m).fitted is not None]
    if not modules:
        raise ValueError("model has no fitted maps: convert(...) it or load_fitted(...) first")
    settings = dict(getattr(model.config, "linattn", None) or {})
    saved = save_state(model)
    start = time.perf_counter()
    try:
        model.eval()
        use_linattn(model)
        with torch.no_grad():
            exact_hook = _Hook(None, settings)
            fit_exact = [_hidden(model, b, exact_hook) for b in fit_inputs]
            val_exact = [_hidden(model, b, exact_hook) for b in val_inputs]
        dtype = torch.promote_types(fit_exact[0].dtype, torch.float32)
        device = model_device(model)
        layers = {id(m): _layer(m, dtype, device) for m in modules}
        hook = _Hook(layers, settings)
        leaves = [t for layer in layers.values() for t in layer.values.values()]

        def validation_error() -> float:
            err = norm = 0.0
            with torch.no_grad():
                for b, exact in zip(val_inputs, val_exact, strict=True):
                    e, n = error_of(_hidden(model, b, hook), exact.to(dtype), b)
                    err, norm = err + float(e), norm + float(n)
            return math.sqrt(err / norm)

        history = [(0, validation_error())]
        if progress is not None:
            progress(f"refine step 0/{steps}: validation error {history[0][1]:.4g}")
        best = (history[0][1], 0, [t.detach().clone() for t in leaves])
        optimiser = torch.optim.Adam(leaves, lr=learning_rate)
        for step in range(1, steps + 1):
            index = (step - 1) % len(fit_inputs)
            b = fit_inputs[index]
            with torch.enable_grad():
                e, n = error_of(_hidden(model, b, hook), fit_exact[index].to(dtype), b)
                grads = torch.autograd.grad(e / n, leaves, allow_unused=True)
            for leaf, grad in zip(leaves, grads, strict=True):
                leaf.grad = torch.zeros_like(leaf) if grad is None else grad
            optimiser.step()
            if step % evaluate_every == 0 or step == steps:
                history.append((step, validation_error()))
                if progress is not None:
                    progress(f"refine step {step}/{steps}: validation error {history[-1][1]:.4g}")
                if history[-1][1] < best[0]:
                    best = (history[-1][1], step, [t.detach().clone() for t in leaves])
        with torch.no_grad():
            for leaf, value in zip(leaves, best[2], strict=True):
                leaf.copy_(value)
        for layer in layers.values():
            update(layer.module, fitted=layer.feature_map_now())
    except BaseException:
        restore_state(model, saved)
        raise
    model.train(saved.training)
    record = dict(model.__dict__.get("_linattn_conversion") or {})
    record["refine"] = {
        "steps": steps, "learning_rate": learning_rate, "loss": loss, "kept_step": best[1],
        "validation_error": history, "seconds": time.perf_counter() - start,
    }  # fmt: skip
    model.__dict__["_linattn_conversion"] = record
    return model
