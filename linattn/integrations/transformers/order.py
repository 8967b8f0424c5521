"""Sinks are each row's first *real* tokens, whatever the padding: a stable reordering.

``linear_attention``'s ``sink_keys`` are the first positions of the sequence.  A batch
that transformers pads on the left (decoders' ``generate``) puts padding there, so a
padded row would lose its sinks to the far part and its outputs would depend on how
much padding the batch has.  The integration reorders each row's positions before the
call and puts them back after it (:class:`SinksFirst`):

* **causal**: the row's first ``sink_keys`` real tokens move to the front, every other
  position keeps its place.  Real tokens keep their order and every real token past the
  sinks keeps its position, so the window, causality and a decoding state continued
  from the call (the next token at position ``L``) are those of the unpadded row;
* **bidirectional**: the real tokens move to the front in order (the batch as if padded
  on the right), which is the unpadded row followed by masked keys.

Only a decoding state's first call is reordered: the tokens that follow are real.  A
row whose first call has fewer real tokens than ``sink_keys`` gets the rest of its
sinks from no later token (its sink positions are taken by padding), unlike the
unpadded row; prompts are longer than the 1 to 4 sinks in use.
"""

from __future__ import annotations

import torch

__all__ = ["SinksFirst"]


class SinksFirst:
    """Each row's positions reordered so that its sinks come first.

    Parameters
    ----------
    order : int64 tensor, shape ``(B, L)``
        Row ``b`` of the reordered call reads position ``order[b, i]`` at ``i``.

    Examples
    --------
    >>> import torch
    >>> mask = torch.tensor([[[0, 0, 1, 1, 1]], [[1, 1, 1, 1, 1]]], dtype=torch.bool)
    >>> order = SinksFirst.of(mask, sink_keys=1, causal=True)
    >>> order.order
    tensor([[2, 0, 1, 3, 4],
            [0, 1, 2, 3, 4]])
    >>> order.take_mask(mask).int()[:, 0]
    tensor([[1, 0, 0, 1, 1],
            [1, 1, 1, 1, 1]], dtype=torch.int32)
    >>> SinksFirst.of(mask[1:], sink_keys=1, causal=True) is None  # nothing to move
    True
    """

    def __init__(self, order: torch.Tensor) -> None:
        self.order = order

    @classmethod
    def of(cls, key_mask: torch.Tensor | None, sink_keys: int, causal: bool) -> SinksFirst | None:
        """The reordering ``key_mask`` ``(B, 1, L)`` (True = a real token) needs for
        ``sink_keys`` sinks; None when no row needs one (no sinks, no mask, padding on
        the right only).  Under ``torch.compile`` the rows are always reordered (no
        data-dependent branch in the graph)."""
        if not sink_keys or key_mask is None:
            return None
        real = key_mask[:, 0]
        front = real & (real.cumsum(-1) <= sink_keys) if causal else real
        moved = front[..., 1:] & ~front[..., :-1]  # a front position after another one
        if not torch.compiler.is_compiling() and not bool(moved.any()):
            return None
        return cls(torch.argsort((~front).to(torch.int8), dim=-1, stable=True))

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(B, H, L, d)`` with its positions (axis -2) reordered."""
        index = self.order[:, None, :, None].expand(x.shape[0], x.shape[1], -1, x.shape[-1])
        return x.gather(-2, index)

    def take_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """``mask`` ``(B, 1, L)`` reordered."""
        return mask.expand(self.order.shape[0], 1, -1).gather(-1, self.order[:, None, :])

    def take_call(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_mask: torch.Tensor,
        exact_key_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """An attention call's ``q``, ``k``, ``v`` ``(B, H, L, .)`` and its ``(B, 1, L)``
        masks reordered (``exact_key_mask`` may be None), in that order."""
        exact = None if exact_key_mask is None else self.take_mask(exact_key_mask)
        return self.take(q), self.take(k), self.take(v), self.take_mask(key_mask), exact

    def restore(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` ``(B, H, L, d)`` of the reordered call, back in the call's order."""
        index = self.order[:, None, :, None].expand(out.shape)
        return torch.empty_like(out).scatter_(-2, index, out)
