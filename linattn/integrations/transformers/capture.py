"""The capture hook of a conversion: each attention call as one :class:`AttentionCall`,
handed to the current thread's hook (exact attention, a layer's activations recorded,
or :func:`linattn.integrations.transformers.refine`'s differentiable form), and the
forward passes that capture one layer.

Activations are captured through the attention call itself: what the layer's attention
function receives (queries and keys after rotary embeddings, key/value heads of
grouped-query attention not repeated, the key mask transformers built), layer by layer,
so memory holds one layer's calibration set.  Each layer's pass stops the forward once
its attention is reached.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from linattn.integrations.transformers.options import Model, options_for
from linattn.integrations.transformers.order import SinksFirst
from linattn.transfer import LayerBatch

__all__ = [
    "AttentionCall",
    "Capture",
    "Captured",
    "Hook",
    "capture_hook",
    "check_batches",
    "exact_attention",
    "hooked",
    "model_device",
    "run",
]


class AttentionCall(NamedTuple):
    """One attention call as the integration has read it (for :func:`capture_hook`).

    ``key_mask`` and ``exact_key_mask`` are ``(B, 1, L_k)`` booleans or None; ``causal``
    is the call's causality, mask included; ``scaling`` and ``is_causal`` and ``kwargs``
    are transformers' arguments as given.
    """

    module: torch.nn.Module
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attention_mask: torch.Tensor | None
    scaling: float | None
    is_causal: bool | None
    kwargs: dict[str, Any]
    key_mask: torch.Tensor | None
    exact_key_mask: torch.Tensor | None
    causal: bool


Hook = Callable[[AttentionCall], "torch.Tensor | None"]
_capture = threading.local()


def capture_hook() -> Hook | None:
    """The current thread's capture (inside :func:`~linattn.integrations.transformers.convert` or
    :func:`~linattn.integrations.transformers.layer_errors`).

    The integration's attention calls it with each :class:`AttentionCall`: it returns
    the output ``(B, L, H, d_v)`` to use, or None for the integration's own attention,
    or raises to end the forward pass once the layer it wants is captured.
    """
    hook: Hook | None = getattr(_capture, "hook", None)
    return hook


@contextlib.contextmanager
def hooked(hook: Hook) -> Iterator[None]:
    """Every attention call of the current thread goes to ``hook`` inside the block."""
    _capture.hook = hook
    try:
        yield
    finally:
        _capture.hook = None


class Captured(Exception):
    """Ends a forward pass at the layer being captured."""


@dataclass
class Capture:
    """One layer's capture: exact (or converted) attention before it, record it, stop."""

    stitch: str
    order: list[torch.nn.Module] = field(default_factory=list)
    target: int | None = None  # None: the first pass, which records the layer order
    batch: LayerBatch | None = None
    causal: bool = False
    scaling: float | None = None

    def __call__(self, call: AttentionCall) -> torch.Tensor | None:
        if self.target is None:
            if any(call.module is seen for seen in self.order):
                raise ValueError(
                    f"convert needs one attention module per layer; {type(call.module).__name__}"
                    " is called twice in one forward pass (layers sharing weights)"
                )
            self.order.append(call.module)
            return exact_attention(call)
        layer = next((i for i, m in enumerate(self.order) if m is call.module), None)
        if layer is None:
            raise ValueError(
                f"an attention module ({type(call.module).__name__}) ran that the first pass "
                "did not see: convert needs the same layers on every input"
            )
        if layer < self.target:
            return None if self.stitch == "converted" else exact_attention(call)
        query, key = call.query, call.key
        if query.shape[-2] != key.shape[-2]:
            raise ValueError(
                f"convert fits self-attention: got {query.shape[-2]} queries against "
                f"{key.shape[-2]} keys in {type(call.module).__name__} (cross-attention or "
                "a cache)"
            )
        batch, length = int(key.shape[0]), int(key.shape[-2])
        key_mask = (
            torch.ones(batch, length, dtype=torch.bool, device=key.device)
            if call.key_mask is None
            else call.key_mask.expand(batch, 1, length)[:, 0]
        )
        value, mask, exact = call.value, key_mask[:, None], call.exact_key_mask
        # The fit sees the rows as the attention runs them: each row's sinks first.
        reorder = SinksFirst.of(mask, options_for(call.module)["sink_keys"], call.causal)
        if reorder is not None:
            query, key, value, mask, exact = reorder.take_call(query, key, value, mask, exact)
        dtype = torch.promote_types(query.dtype, torch.float32)  # half precision: fit in float32
        q, k, v = (x.detach().to(dtype) for x in (query, key, value))
        self.batch = LayerBatch(q, k, v, mask[:, 0], None if exact is None else exact[:, 0])
        self.causal, self.scaling = call.causal, call.scaling
        raise Captured


def exact_attention(call: AttentionCall) -> torch.Tensor:
    """SDPA on the call (its mask is SDPA's: the integration borrows SDPA's mask function)."""
    out, _ = sdpa_attention_forward(
        call.module, call.query, call.key, call.value, call.attention_mask,
        scaling=call.scaling, is_causal=call.is_causal, **call.kwargs,
    )  # fmt: skip
    result: torch.Tensor = out
    return result


# -- inputs -------------------------------------------------------------------------------


def check_batches(batches: Iterable[Any], name: str) -> list[dict[str, Any]]:
    """The batches as a list, each checked: input_ids and attention_mask, real tokens."""
    if isinstance(batches, Mapping):
        raise TypeError(
            f"{name} must be an iterable of batches (dicts of input_ids and attention_mask, "
            "tokenizer output); got one dict: wrap it in a list"
        )
    out: list[dict[str, Any]] = []
    for index, batch in enumerate(batches):
        if not isinstance(batch, Mapping) or not {"input_ids", "attention_mask"} <= set(batch):
            got = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
            raise ValueError(
                f"{name}[{index}] must be a dict with input_ids and attention_mask tensors "
                f"(tokenizer output with return_tensors='pt'); got {got}"
            )
        ids, mask = batch["input_ids"], batch["attention_mask"]
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(ids.shape):
            raise ValueError(
                f"{name}[{index}]: attention_mask must be a tensor shaped like input_ids "
                f"{tuple(ids.shape)}; got {getattr(mask, 'shape', type(mask).__name__)}"
            )
        if ids.ndim != 2 or not bool(mask.bool().any()):
            raise ValueError(
                f"{name}[{index}] has no real tokens (attention_mask is all 0, or the batch "
                f"is empty: shape {tuple(ids.shape)}): calibration batches need text"
            )
        out.append(dict(batch))
    if not out:
        raise ValueError(f"{name} must hold at least one batch; got none")
    return out


def model_device(model: Model) -> torch.device:
    parameter = next(model.parameters(), None)
    return torch.device("cpu") if parameter is None else parameter.device


def run(model: Model, batch: dict[str, Any], capture: Capture) -> LayerBatch | None:
    """One forward pass of ``batch`` under ``capture``, stopped once it has its layer:
    that layer's batch (None on the first pass, which runs to the end)."""
    device = model_device(model)
    inputs = {n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in batch.items()}
    if "use_cache" in inspect.signature(model.forward).parameters:
        inputs["use_cache"] = False  # no transformers cache: the keys are the inputs'
    capture.batch = None
    try:
        with hooked(capture):
            model(**inputs)
    except Captured:
        captured, capture.batch = capture.batch, None
        return captured
    if capture.target is not None:
        raise ValueError(
            f"the forward pass never reached attention layer {capture.target}: convert needs "
            "the same layers on every input"
        )
    return None
