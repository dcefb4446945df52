"""Load-imbalance models (jaxcomm.imbalance): shapes, determinism, the paper's patterns, statistics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxcomm.imbalance as im

pytestmark = pytest.mark.strict_promotion

KEY = jax.random.key(0)


def test_every_model_is_jittable_and_deterministic():
    models = [
        im.RandomDelay(8, 2, 320.0, base_ms=5.0, replace=True),
        im.RandomDelay(8, 1, 200.0),
        im.LinearSkew(8),
        im.RotatingSkew(8),
        im.EmpiricalTimes(8, [201.0, 1235.0, 3410.0]),
        im.EmpiricalTimes(2, [[1.0, 2.0], [3.0, 4.0]]),
    ]
    for m in models:
        assert isinstance(m, im.ImbalanceModel)
        f = jax.jit(m.sample)
        a, b = f(KEY, jnp.int32(3)), f(KEY, jnp.int32(3))
        assert a.shape == (m.num_workers,) and a.dtype == jnp.float32
        np.testing.assert_array_equal(a, b)  # same key and step -> same draw (shared stream)
        assert np.all(np.asarray(a) >= 0)
        hash(m)  # static under jit


def test_schedule_rows_are_samples():
    m = im.RandomDelay(4, 1, 10.0)
    table = im.schedule(m, 7, 5)
    assert table.shape == (5, 4) and table.dtype == np.float32
    for t in range(5):
        np.testing.assert_array_equal(table[t], np.asarray(m.sample(jax.random.key(7), t)))
    assert im.schedule(m, 0, 0).shape == (0, 4)


@settings(max_examples=6)
@given(p=st.integers(1, 12), r=st.integers(0, 12), step=st.integers(0, 1000))
def test_random_delay_delays_exactly_r_distinct_workers(p, r, step):
    r = min(r, p)
    times = np.asarray(im.RandomDelay(p, r, 50.0, base_ms=3.0).sample(KEY, step))
    assert np.sum(times == 53.0) == r
    assert np.sum(times == 3.0) == p - r


def test_random_delay_with_replacement_delays_up_to_r():
    # The reference: "up to 2 random ranks by 320 ms, same random stream on all ranks".
    m = im.RandomDelay(8, 2, 320.0, replace=True)
    counts = (im.schedule(m, 1, 400) == 320.0).sum(1)
    assert set(np.unique(counts)) <= {1, 2}
    # P(both draws hit the same rank) = 1/8; 400 steps: mean 50, sd sqrt(400 * 1/8 * 7/8) = 6.6.
    assert abs(np.sum(counts == 1) - 50) < 5 * 6.6


def test_random_delay_is_uniform_over_workers():
    # Each worker is delayed with probability r/P = 1/8 per step; over T = 800 steps the
    # count is Binomial(800, 1/8): mean 100, sd sqrt(800/8 * 7/8) = 9.35; 5 sd tolerance.
    table = im.schedule(im.RandomDelay(8, 1, 100.0), 3, 800)
    per_worker = (table == 100.0).sum(0)
    assert np.all(np.abs(per_worker - 100) < 5 * 9.35)


def test_linear_skew_is_one_to_p_ms():
    np.testing.assert_array_equal(im.LinearSkew(32).sample(KEY, 5), np.arange(1, 33, dtype=np.float32))
    np.testing.assert_allclose(im.LinearSkew(4, unit_ms=2.5, base_ms=1.0).sample(KEY, 0), [3.5, 6.0, 8.5, 11.0])


def test_rotating_skew_rotates_the_levels_every_step():
    m = im.RotatingSkew(8, 50.0, 400.0)
    table = im.schedule(m, 0, 9)
    levels = np.linspace(50.0, 400.0, 8).astype(np.float32)
    np.testing.assert_array_equal(table[0], levels)
    for t in range(8):
        np.testing.assert_array_equal(np.sort(table[t]), levels)  # one worker per level
        np.testing.assert_array_equal(table[t + 1], np.roll(table[t], -1))  # shifted by one
    np.testing.assert_array_equal(table[8], table[0])  # period P


def test_empirical_one_d_draws_from_the_list_uniformly():
    values = [201.0, 475.0, 1235.0, 3410.0]
    table = im.schedule(im.EmpiricalTimes(4, values), 5, 500)  # 2000 draws
    assert set(np.unique(table)) <= set(values)
    # Multinomial(2000, 1/4 each): mean 500, sd sqrt(2000 * 1/4 * 3/4) = 19.4; 5 sd.
    counts = np.array([np.sum(table == v) for v in values])
    assert np.all(np.abs(counts - 500) < 5 * 19.4)


def test_empirical_two_d_replays_the_table():
    rows = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    table = im.schedule(im.EmpiricalTimes(3, rows, base_ms=10.0), 0, 5)
    np.testing.assert_array_equal(table, np.array([rows[0], rows[1]] * 2 + [rows[0]]) + 10.0)


def test_make_by_name():
    assert im.make("rotating_skew", 8) == im.RotatingSkew(8)
    assert set(im.names()) == {"random_delay", "linear_skew", "rotating_skew", "empirical"}


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: im.RandomDelay(0), "num_workers"),
        (lambda: im.RandomDelay(4, 5), "num_delayed"),
        (lambda: im.RandomDelay(4, 1, -1.0), "delay_ms"),
        (lambda: im.LinearSkew(4, unit_ms=0.0), "unit_ms"),
        (lambda: im.RotatingSkew(4, 400.0, 50.0), "max_ms"),
        (lambda: im.EmpiricalTimes(3, [[1.0, 2.0]]), "columns"),
        (lambda: im.EmpiricalTimes(3, []), "times_ms"),
        (lambda: im.EmpiricalTimes(3, [1.0, float("nan")]), "times_ms"),
        (lambda: im.make("gaussian", 4), "unknown imbalance model"),
        (lambda: im.schedule(im.LinearSkew(2), 0, -1), "num_steps"),
    ],
)
def test_bad_input_names_the_argument(build, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build()
