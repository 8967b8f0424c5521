"""Exact attention where the mass concentrates, random features for the rest.

Attention in pretrained models puts most of its mass on a few neighbours and on a few
"sink" keys (the first tokens, ``[CLS]``, ``[SEP]``); random features spread their
variance over every key alike.  The hybrid (``docs/algorithm.md``, section 17) gives
each key to exactly one *part*:

* the **window**: keys within ``w`` positions (causal ``t - w < j <= t``,
  bidirectional ``|t - j| < w``), exact weights ``exp(s q.k)``;
* the **exact keys**: the first ``sink_keys`` positions, and in bidirectional attention
  the keys of ``exact_key_mask``, exact weights for every query (causal: ``j <= t``);
* the **far keys**: everything else, estimated by the feature map's random features
  (none: exact sliding-window attention).

No estimate is ever subtracted.  Each part yields a stabilised partial
``(P, c)``: unnormalised ``[numerator | denominator]`` rows ``P`` whose unstabilised
value is ``exp(c) P``; :func:`merge` adds them as online softmax does.  The far keys of
causal attention are the causal pass on keys *lagged* by ``w`` (query ``t`` reads the
state of keys ``j <= t - w``); bidirectional attention adds a reverse lagged pass
(``j >= t + w``).  A causal state carries the random-feature state of the keys that
left the window, the last ``w`` keys and values, and the sink keys, so that a sequence
fed whole, in pieces or one token at a time gives the same outputs, and a decoding step
costs ``O(m d + (w + s) d)``.

The package: :mod:`~linattn.hybrid.merge` (partial rows and their merge, the window's
band), :mod:`~linattn.hybrid.parts` (each part with its rows and adjoint),
:mod:`~linattn.hybrid.build` (the parts of one call, checked) and
:mod:`~linattn.hybrid.paths` (the one-pass kernels, the merged rows, the VJP).
"""

from linattn.hybrid.build import ExactParts, check_exact_parts
from linattn.hybrid.merge import banded_partial, merge, softmax_partial

__all__ = ["ExactParts", "banded_partial", "check_exact_parts", "merge", "softmax_partial"]
