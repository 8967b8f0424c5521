"""Adam on host parameters: the fitted parameters as named NumPy arrays
(:func:`values_of`, the far weight as its logarithm), the step (:class:`Adam`), and the
parameters again (:func:`parameters_of`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from linattn import fitted
from linattn.fitted import FittedParameters

__all__ = ["Adam", "parameters_of", "values_of"]


@dataclass
class Adam:
    """Adam's state (its moments per parameter name) and step on host arrays."""

    rate: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    step: int = 0
    moments: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def update(
        self, values: dict[str, np.ndarray], grads: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        self.step += 1
        out = {}
        for name, value in values.items():
            g = grads[name]
            m, v = self.moments.get(name, (np.zeros_like(value), np.zeros_like(value)))
            m = self.beta1 * m + (1 - self.beta1) * g
            v = self.beta2 * v + (1 - self.beta2) * g * g
            self.moments[name] = (m, v)
            m_hat = m / (1 - self.beta1**self.step)
            v_hat = v / (1 - self.beta2**self.step)
            out[name] = value - self.rate * m_hat / (np.sqrt(v_hat) + self.eps)
        return out


def values_of(p: FittedParameters) -> dict[str, np.ndarray]:
    """The parameters the fit moves, as host arrays by name (``g`` as ``log_far_weight``)."""
    names = ["query_weight", "query_bias"] + ([] if p.tied else ["key_weight", "key_bias"])
    values = {name: np.array(getattr(p, name)) for name in names}
    values["log_far_weight"] = np.array(fitted.log_far_weight(p))
    return values


def parameters_of(values: dict[str, np.ndarray], tied: bool) -> FittedParameters:
    """The fitted parameters of :func:`values_of`'s arrays."""
    return fitted.check_parameters(
        values["query_weight"],
        values["query_bias"],
        None if tied else values["key_weight"],
        None if tied else values["key_bias"],
        np.exp(values["log_far_weight"]),
        tied=tied,
    )
