"""``linattn.torch``, a package of one topic a module: short modules, the public names
where they were, ``import torch`` inside it PyTorch."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import linattn.torch as lt  # noqa: E402
from linattn.torch import fitted, layers, multihead  # noqa: E402

PACKAGE = Path(lt.__file__).parent
MODULES = (fitted, layers, multihead)
#: No module of the library is longer.
MAX_LINES = 600


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("*.py")), ids=lambda path: path.name)
def test_modules_are_short(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= MAX_LINES


def test_public_names() -> None:
    assert lt.__all__ == ["FastAttention", "MultiheadAttention", "fitted_attention"]
    assert lt.FastAttention is layers.FastAttention
    assert lt.MultiheadAttention is multihead.MultiheadAttention
    assert lt.fitted_attention is fitted.fitted_attention
    assert lt.FITTED_BUFFERS is fitted.FITTED_BUFFERS
    assert lt.HYBRID_OPTIONS is layers.HYBRID_OPTIONS


def test_torch_inside_the_package_is_pytorch() -> None:
    for module in MODULES:
        assert vars(module)["torch"] is torch, module.__name__
