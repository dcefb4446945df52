"""Topologies: mixing matrices, their permutations, spectral gaps and validation."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcomm import topology as T

pytestmark = pytest.mark.strict_promotion


def _mix_by_permutations(t, x):
    """What the collectives compute: W_ii x_i + sum_k receive_weights[k, i] x_{src_k(i)}."""
    y = t.self_weights[:, None] * x
    for k in range(t.num_permutations):
        perm = t.permutations[k]
        assert sorted(s for s, _ in perm) == list(range(t.num_workers))  # a full permutation
        assert sorted(d for _, d in perm) == list(range(t.num_workers))
        y = y + t.receive_weights[k][:, None] * x[t.sources(k)]
    return y


def _metropolis(adj):
    """Metropolis-Hastings weights of a graph: symmetric and doubly stochastic by construction."""
    n = adj.shape[0]
    deg = adj.sum(1)
    w = np.zeros((n, n))
    for i in range(n):
        for j in range(n):
            if adj[i, j]:
                w[i, j] = 1.0 / (1 + max(deg[i], deg[j]))
    w[np.arange(n), np.arange(n)] = 1 - w.sum(1)
    return w


@pytest.mark.parametrize("n", [3, 4, 5, 8, 16])
def test_ring_weights_are_one_third_on_self_left_right(n):
    t = T.ring(n)
    expected = np.zeros((n, n))
    for i in range(n):
        expected[i, [i, (i - 1) % n, (i + 1) % n]] = 1 / 3
    np.testing.assert_allclose(t.weights, expected, atol=1e-15)
    assert t.num_permutations == 2 and list(t.degrees) == [2] * n
    assert t.neighbors(0) == tuple(sorted({1, n - 1}))
    # Ring eigenvalues (1 + 2 cos(2 pi k / n)) / 3: the gap in closed form.
    lam = [(1 + 2 * np.cos(2 * np.pi * k / n)) / 3 for k in range(1, n)]
    assert t.spectral_gap == pytest.approx(1 - max(abs(v) for v in lam), abs=1e-12)
    assert t.rho == pytest.approx(max(abs(v) for v in lam) ** 2, abs=1e-12)


def test_small_rings():
    np.testing.assert_allclose(T.ring(2).weights, [[1 / 3, 2 / 3], [2 / 3, 1 / 3]])
    np.testing.assert_allclose(T.ring(1).weights, [[1.0]])
    assert T.ring(1).num_permutations == 0 and T.ring(1).spectral_gap == 1.0


@pytest.mark.parametrize(
    "t, degree",
    [
        (T.torus(4, 4), 4),
        (T.torus(3, 5), 4),
        (T.torus(2, 4), 3),
        (T.exponential(8), 5),
        (T.exponential(16), 7),
        (T.exponential(6), 4),
        (T.complete(5), 4),
        (T.ring(7), 2),
    ],
    ids=lambda v: repr(v) if not isinstance(v, int) else str(v),
)
def test_named_topologies_are_valid_and_permutations_reproduce_w(t, degree):
    n = t.num_workers
    T.validate_mixing_matrix(t.weights, n)
    assert list(t.degrees) == [degree] * n
    np.testing.assert_allclose(np.diag(t.weights), 1 / (degree + 1))
    x = np.random.default_rng(0).standard_normal((n, 3))
    np.testing.assert_allclose(_mix_by_permutations(t, x), t.weights @ x, atol=1e-12)
    assert t.receive_mask.all()  # shift topologies need no padding
    assert 0 < t.spectral_gap <= 1
    np.testing.assert_allclose(t.spectral_gap, T.spectral_gap(t.weights))


def test_torus_neighbours_and_complete_gap():
    t = T.torus(3, 4)  # worker i = r * 4 + c
    assert t.neighbors(5) == (1, 4, 6, 9)  # (1,1): up (0,1)=1, left (1,0)=4, right (1,2)=6, down (2,1)=9
    assert T.complete(6).spectral_gap == pytest.approx(1.0)  # W = J/n: all other eigenvalues 0
    np.testing.assert_allclose(T.complete(6).weights, np.full((6, 6), 1 / 6))
    assert T.make("torus", 16).name == "torus(4x4)"


@settings(max_examples=15)
@given(st.integers(2, 11), st.integers(0, 2**31 - 1), st.floats(0.15, 0.7))
def test_user_matrix_permutations_reproduce_w(n, seed, p):
    rng = np.random.default_rng(seed)
    adj = np.triu(rng.random((n, n)) < p, 1)
    adj = adj | adj.T
    w = _metropolis(adj)
    t = T.from_matrix(w, n, allow_disconnected=True)
    x = rng.standard_normal((n, 2))
    np.testing.assert_allclose(_mix_by_permutations(t, x), w @ x, atol=1e-12)
    # Every real edge is delivered exactly once; padding pairs carry weight 0.
    np.testing.assert_array_equal(t.receive_mask.sum(0), adj.sum(1))
    assert np.all(t.receive_weights[~t.receive_mask] == 0)
    if not T._is_circulant(w):
        # Koenig: a bipartite multigraph needs exactly max-degree colours.
        assert t.num_permutations == adj.sum(1).max()


def test_validation_errors():
    with pytest.raises(ValueError, match="doubly stochastic"):
        T.from_matrix([[0.5, 0.5], [0.5, 0.6]])
    with pytest.raises(ValueError, match="doubly stochastic"):
        T.from_matrix(np.full((3, 3), 0.3))
    with pytest.raises(ValueError, match="symmetric"):
        T.from_matrix([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5], [0.5, 0.0, 0.5]])
    with pytest.raises(ValueError, match="4 workers"):
        T.from_matrix(T.ring(3).weights, num_workers=4)
    with pytest.raises(ValueError, match="square"):
        T.from_matrix(np.ones((2, 3)) / 3)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        T.from_matrix([[1.5, -0.5], [-0.5, 1.5]])
    with pytest.raises(ValueError, match="disconnected"):
        T.from_matrix(np.eye(3))
    with pytest.raises(TypeError, match="weights"):
        T.from_matrix("ring")
    with pytest.raises(ValueError, match="unknown topology"):
        T.make("star", 4)
    with pytest.raises(ValueError, match="num_workers"):
        T.ring(0)
    with pytest.raises(ValueError, match=r"topology 'ring' has 4 workers but the communicator has 8"):
        T.ring(4).check_workers(8)
    with pytest.raises(ValueError, match="4 workers"):
        T.as_topology(T.ring(3), num_workers=4)
    assert T.from_matrix(np.eye(2), allow_disconnected=True).num_permutations == 0
