"""The frontier arithmetic behind the benchmarks' verdicts (bench/common.py): the Pareto front, a frontier's speed
interpolated in log KL, and the envelope check (our fastest point at or below each KL against a peer's frontier over
the peer's KL range) against brute force on a dense grid of KLs; a stock line's KL at given bytes per token."""
from __future__ import annotations

import math
import random
import sys

from testkit import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from common import envelope_check, frontier_speed, kl_at_bytes, pareto


def _best_at_or_below(ours: list[tuple[float, float]], x: float) -> float:
    return max((t for k, t in ours if k <= x), default=0.0)


def test_pareto_keeps_points_nothing_beats() -> None:
    pts = [(0.2, 20.0), (0.07, 23.0), (0.02, 19.0), (0.01, 17.0), (0.05, 15.0)]
    assert pareto(pts) == [(0.01, 17.0), (0.02, 19.0), (0.07, 23.0)]


def test_frontier_speed_interpolates_in_log_kl() -> None:
    front = [(0.01, 10.0), (0.1, 20.0)]
    assert frontier_speed(front, math.sqrt(0.01 * 0.1)) == (15.0, "interp")
    assert frontier_speed(front, 0.001) == (10.0, "below")
    assert frontier_speed(front, 1.0) == (20.0, "above")


def test_envelope_check_matches_a_dense_grid() -> None:
    rng = random.Random(7)
    for _ in range(150):
        peer = [(10 ** rng.uniform(-2.5, -0.5), rng.uniform(10, 30)) for _ in range(rng.randint(2, 5))]
        ours = [(10 ** rng.uniform(-3, 0), rng.uniform(10, 35)) for _ in range(rng.randint(1, 6))]
        got = envelope_check(ours, peer)
        front = pareto(peer)
        lo, hi = front[0][0], max(k for k, _ in peer)
        assert (got.lo, got.hi) == (lo, hi)
        grid = [lo * (hi / lo) ** (i / 5000) for i in range(5001)]
        ratios = [_best_at_or_below(ours, x) / frontier_speed(front, x)[0] for x in grid]
        # the exact minimum is a left limit the grid approaches from above, never passes
        assert got.worst_ratio <= min(ratios) + 1e-12
        assert min(ratios) - got.worst_ratio < 0.01 * max(1.0, got.worst_ratio)
        assert got.holds == (got.worst_ratio > 1.0)


def test_envelope_needs_a_point_as_good_as_the_peers_best() -> None:
    peer = [(0.01, 17.0), (0.02, 19.0), (0.07, 23.0), (0.2, 21.0)]
    fast_but_coarse = [(0.03, 40.0), (0.06, 45.0)]  # much faster, but nothing at KL 0.01
    got = envelope_check(fast_but_coarse, peer)
    assert not got.holds and got.worst_ratio == 0.0 and got.worst_kl < 0.03
    covered = [*fast_but_coarse, (0.009, 18.0)]  # now a point below the peer's lowest KL, faster than it
    got = envelope_check(covered, peer)
    # worst just below KL 0.03, where only the 18 tok/s point is available and the peer's frontier is ~20
    assert not got.holds and abs(got.worst_kl - 0.03) < 1e-12
    assert abs(got.worst_ratio - 18.0 / frontier_speed(pareto(peer), 0.03)[0]) < 1e-12


def test_kl_at_bytes_interpolates_log_kl_in_bytes_on_the_line() -> None:
    # a point with more bytes and higher KL than a smaller one is off the line (never interpolated through)
    pts = [(400.0, 0.2), (480.0, 0.08), (500.0, 0.09), (600.0, 0.01)]
    kl, how = kl_at_bytes(pts, 540.0)
    assert how == "interp" and kl is not None
    assert abs(kl - math.sqrt(0.08 * 0.01)) < 1e-12  # halfway in bytes: the geometric mean
    kl, how = kl_at_bytes(pts, 480.0)
    assert how == "interp" and kl is not None and abs(kl - 0.08) < 1e-12
    assert kl_at_bytes(pts, 399.0) == (None, "below")
    assert kl_at_bytes(pts, 601.0) == (None, "above")
