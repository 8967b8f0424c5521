"""What the torch custom operators of :mod:`linattn_numba.torch_ops` share: their namespace,
fake-tensor helpers, the refusals (double backward, ``vmap``) and the ``torch.func`` form.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = [
    "NAMESPACE",
    "Grads",
    "as_numpy",
    "compute_dtype",
    "for_torch_func",
    "fresh_like",
    "no_double_backward",
    "no_setup",
    "no_vmap",
]

NAMESPACE = "linattn"

Grads = tuple[Tensor, Tensor, Tensor, Tensor]


def compute_dtype(x: Tensor) -> torch.dtype:
    """float64 stays; everything else computes (and returns) float32, as the kernels do."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def fresh_like(x: Tensor, dtype: torch.dtype) -> Tensor:
    return x.new_empty(x.shape, dtype=dtype)  # contiguous, like the kernels' results


def no_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    pass


def no_double_backward(ctx: Any, *grads: Any) -> Any:
    raise NotImplementedError(
        "second derivatives through the linattn Numba kernels (linattn::causal_backward and "
        "the fused backward operators) are not supported; pass backend='array_api' to "
        "linattn for the portable path"
    )


def no_vmap(name: str) -> Any:
    def rule(info: Any, in_dims: Any, *args: Any) -> Any:
        raise NotImplementedError(
            f"torch.func.vmap over linattn::{name} (the linattn Numba kernel) is not "
            "supported yet; the kernel maps over leading batch axes itself, so call it on "
            "the batched inputs without vmap, or pass backend='array_api' to linattn"
        )

    return rule


def for_torch_func(op: Any, setup_context: Any, backward: Any) -> Any:
    """``op`` as an ``autograd.Function`` with ``setup_context``, ``backward`` and a vmap
    rule that refuses: ``torch.func.grad`` and ``vjp`` reject the function that
    ``register_autograd`` generates (it has no ``setup_context``), and accept this one,
    which shares the formula.  (``torch.compile`` gets the operator itself.)"""
    name = op._qualname.split("::")[-1]
    return type(
        f"_{name}",
        (torch.autograd.Function,),
        {
            "forward": staticmethod(lambda *args: op(*args)),
            "setup_context": staticmethod(setup_context),
            "backward": staticmethod(backward),
            "vmap": staticmethod(no_vmap(name)),
        },
    )


def as_numpy(x: Tensor | None) -> Any:
    return None if x is None else x.detach().numpy()
