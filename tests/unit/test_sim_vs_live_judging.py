"""bench/sim_vs_live.py's judging, on hand-made figures: what counts as met, for the policy comparison
and for the stacks (e2e/test_bench_sim_vs_live.py runs the bench live; a live run cannot be steered
into a miss on purpose)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench() -> Iterator[Any]:
    sys.path.insert(0, str(ROOT / "bench"))  # the bench imports its neighbours (_machine)
    try:
        spec = importlib.util.spec_from_file_location("bench_sim_vs_live", ROOT / "bench" / "sim_vs_live.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("bench_sim_vs_live", None)
        sys.path.remove(str(ROOT / "bench"))


def figures(live_gpu_s: float, sim_gpu_s: float, moves_live: float = 0, moves_sim: float = 0,
            failed: float = 0) -> dict[str, Any]:
    return {"live_gpu_s": live_gpu_s, "sim_gpu_s": sim_gpu_s, "ratio": round(sim_gpu_s / live_gpu_s, 3),
            "migrations": {"live": moves_live, "live_failed": failed, "simulated": moves_sim}}


def test_the_stacks_are_judged_on_the_ratio_between_them_not_on_each_ones_bill(bench: Any) -> None:
    # Slice one: the simulator bills both stacks 20% low, so each stack alone is off by 20%, but the
    # ratio kvfleet/today is the same live and simulated: met. Slice two: live 0.8, simulated 0.6/0.8
    # = 0.75, 6.25% apart: met. Slice three: live 0.5, simulated 0.8: missed.
    slices = [{"window": "0:60", "policies": {"today": figures(100, 80), "kvfleet": figures(80, 64)}},
              {"window": "1200:60", "policies": {"today": figures(100, 80), "kvfleet": figures(80, 60)}},
              {"window": "2400:60", "policies": {"today": figures(100, 100), "kvfleet": figures(50, 80)}}]
    checks, totals = bench.stack_checks(slices)
    assert [" PASS " in c for c in checks] == [True, True, False, False]
    assert slices[0]["stack_ratio"] == {"live": 0.8, "simulated": 0.8, "sim_over_live": 1.0}
    assert slices[1]["stack_ratio"] == {"live": 0.8, "simulated": 0.75, "sim_over_live": 0.9375}
    assert slices[2]["stack_ratio"]["sim_over_live"] == 1.6
    # The sum: live 210/300 = 0.7, simulated 204/260 = 0.785, 12% above it: missed.
    assert totals["live_gpu_s_sum"] == {"today": 300, "kvfleet": 210}
    assert totals["sim_gpu_s_sum"] == {"today": 260, "kvfleet": 204}
    assert totals["stack_ratio"] == {"live": 0.7, "simulated": round(204 / 260, 4), "sim_over_live": round(204 / 260 / 0.7, 4)}
    assert checks[-1].startswith("all slices kvfleet/today MISS")


def test_a_stack_with_no_live_bill_is_a_miss_not_a_division_by_zero(bench: Any) -> None:
    slices = [{"window": "0:10", "policies": {"today": {"live_gpu_s": 0.0, "sim_gpu_s": 5.0},
                                               "kvfleet": {"live_gpu_s": 4.0, "sim_gpu_s": 4.0}}}]
    checks, totals = bench.stack_checks(slices)
    assert all(" MISS " in c for c in checks)
    assert totals["stack_ratio"] == {"live": None, "simulated": 0.8, "sim_over_live": None}


def test_the_policies_are_judged_each_against_its_own_simulation(bench: Any) -> None:
    slices = [{"window": "0:60", "policies": {"mell": figures(100, 95, moves_live=10, moves_sim=11, failed=1),
                                               "bf": figures(110, 125, moves_live=10, moves_sim=5)}}]
    checks, totals = bench.policy_checks(slices)
    verdicts = {c.split(" PASS ")[0].split(" MISS ")[0]: " PASS " in c for c in checks}
    assert verdicts == {"0:60 mell GPU-s": True, "0:60 mell migrations": True, "0:60 bf GPU-s": False,
                        "0:60 bf migrations": False, "failed moves": True, "live default vs best-fit over the slices": True}
    assert totals == {"live_gpu_s_sum": {"mell": 100, "bf": 110}, "failed_move_share": 0.05}
