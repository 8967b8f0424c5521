from __future__ import annotations

import numpy as np
import pytest

from linattn.projections import gaussian_projection, haar_orthogonal


def test_same_seed_same_matrix_other_seed_other_matrix() -> None:
    a = gaussian_projection(40, 8, seed=3)
    np.testing.assert_array_equal(a, gaussian_projection(40, 8, seed=3))
    assert not np.allclose(a, gaussian_projection(40, 8, seed=4))


@pytest.mark.parametrize("num_rows", [1, 7, 8, 20])
def test_orthogonal_blocks(num_rows: int) -> None:
    dim = 8
    w = gaussian_projection(num_rows, dim, seed=0)
    assert w.shape == (num_rows, dim)
    directions = w / np.linalg.norm(w, axis=1, keepdims=True)
    for start in range(0, num_rows, dim):
        block = directions[start : start + dim]
        np.testing.assert_allclose(block @ block.T, np.eye(len(block)), atol=1e-12)


def test_iid_rows_are_not_orthogonal() -> None:
    w = gaussian_projection(8, 8, orthogonal=False, seed=0)
    d = w / np.linalg.norm(w, axis=1, keepdims=True)
    assert np.abs(d @ d.T - np.eye(8)).max() > 0.05


@pytest.mark.parametrize("orthogonal", [True, False])
def test_chi_norms_have_mean_square_dim(orthogonal: bool) -> None:
    # |w|^2 ~ chi^2(d): mean d, variance 2d; 4000 rows give a standard error sqrt(2d/4000).
    d, n = 16, 4000
    sq = np.sum(gaussian_projection(n, d, orthogonal=orthogonal, seed=1) ** 2, axis=1)
    assert abs(sq.mean() - d) < 5 * np.sqrt(2 * d / n)


def test_fixed_norms() -> None:
    w = gaussian_projection(10, 4, norms="fixed", seed=0)
    np.testing.assert_allclose(np.linalg.norm(w, axis=1), 2.0)


def test_haar_sign_convention() -> None:
    # With the sign fix, the diagonal of R in Q^T G is positive, which makes Q Haar.
    rng = np.random.default_rng(5)
    q = haar_orthogonal(6, rng)
    np.testing.assert_allclose(q @ q.T, np.eye(6), atol=1e-12)
    # Haar: the mean of the first diagonal entry over many draws is 0 (it is not for
    # LAPACK's raw Q); standard error 1/sqrt(6 n).
    draws = np.array([haar_orthogonal(6, rng)[0, 0] for _ in range(3000)])
    assert abs(draws.mean()) < 5 / np.sqrt(6 * 3000)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_rows": 0, "dim": 4}, "num_rows must be a positive integer; got 0"),
        ({"num_rows": 4, "dim": -1}, "dim must be a positive integer; got -1"),
        ({"num_rows": 4, "dim": 4, "norms": "unit"}, "norms must be 'chi' or 'fixed'; got 'unit'"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        gaussian_projection(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_rows": True}, ValueError, "num_rows must be a positive integer; got True"),
        ({"dim": 2.0}, ValueError, "dim must be a positive integer; got 2.0"),
        ({"seed": -1}, ValueError, "seed must be a non-negative integer; got -1"),
        ({"seed": 1.5}, ValueError, "seed must be a non-negative integer; got 1.5"),
        ({"orthogonal": "no"}, TypeError, "orthogonal must be True or False; got 'no'"),
        ({"num_rows": 2**20, "dim": 2**9}, ValueError, "num_rows x dim must be at most"),
    ],
)
def test_gaussian_projection_checks_its_arguments(kwargs: dict, error: type, match: str) -> None:
    arguments = {"num_rows": 4, "dim": 4, **kwargs}
    with pytest.raises(error, match=match):
        gaussian_projection(arguments.pop("num_rows"), arguments.pop("dim"), **arguments)
