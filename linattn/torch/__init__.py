"""PyTorch layers: :class:`FastAttention` (an attention op with its own features) and
:class:`MultiheadAttention`, a drop-in for :class:`torch.nn.MultiheadAttention`.

The layers only wire projections, masks and the feature schedule to
:func:`linattn.linear_attention`; they never re-implement attention.  The random
projection is a registered buffer, so it is saved in ``state_dict``, moved by
``.to(device)`` and broadcast by DistributedDataParallel; redraws are seeded from
``seed`` plus a draw counter (also a buffer), so every rank draws the same matrix.
A fitted map's parameters (``feature_map=``, :mod:`linattn.fitted`) are buffers likewise:
fitted by :mod:`linattn.transfer` with the model frozen, not trained by the layer, unless
``train_map=True`` makes them ``nn.Parameter``s.
:func:`fitted_attention` is the call to train them with torch's autograd: the map's
parameters are tensors, differentiated through the dense form of the hybrid at training
lengths (:mod:`linattn._fitted_call`) or :func:`linattn.linear_attention_vjp`
(``parameters=True``) beyond.
Importing :mod:`linattn` never imports this package (or torch).

The package, one topic a module: :mod:`linattn.torch.fitted` (:func:`fitted_attention`),
:mod:`linattn.torch.layers` (:class:`FastAttention`) and :mod:`linattn.torch.multihead`
(:class:`MultiheadAttention`); import them from here.
"""

from __future__ import annotations

from linattn.torch import fitted, layers, multihead  # noqa: F401 (the modules, by name)
from linattn.torch.fitted import FITTED_BUFFERS as FITTED_BUFFERS
from linattn.torch.fitted import fitted_attention
from linattn.torch.layers import HYBRID_OPTIONS as HYBRID_OPTIONS
from linattn.torch.layers import FastAttention
from linattn.torch.multihead import MultiheadAttention

__all__ = ["FastAttention", "MultiheadAttention", "fitted_attention"]
