"""Every benchmark under bench/ has a quick run in `make test`, so none rots silently.

bench/operator_epochs.py once crashed for weeks unnoticed (its in-memory API fell behind the operator).
A benchmark counts as run when a test executes its file (`... / "bench" / "<name>.py"`, the form the
bench tests use) and that test checks its output; this test only makes sure none is left without one.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_benchmark_has_a_test_that_runs_it() -> None:
    benches = sorted(p.name for p in (ROOT / "bench").glob("*.py") if not p.name.startswith("_"))
    assert benches, "no benchmarks found: is bench/ where this test thinks?"
    # tests/ and e2e/ (a benchmark of the live pool needs the control plane the e2e tests have).
    tests = {p: p.read_text() for where in ("tests", "e2e") for p in (ROOT / where).rglob("test_*.py")
             if p.resolve() != Path(__file__).resolve()}
    unrun = [name for name in benches if not any(f'"bench" / "{name}"' in text for text in tests.values())]
    assert not unrun, f"benchmarks no test runs (add a quick run, as tests/worker/test_bench_engine.py does): {unrun}"


def test_every_bench_helper_is_used_by_a_benchmark_that_runs() -> None:
    """bench/_*.py are helpers, not benchmarks: they run when the benchmarks that import them run, so
    each must be imported by at least one benchmark (which the test above makes sure has a quick run)."""
    bench = ROOT / "bench"
    helpers = sorted(p.stem for p in bench.glob("_*.py") if p.name != "__init__.py")
    users = {p.name: p.read_text() for p in bench.glob("*.py") if not p.name.startswith("_")}
    unused = [h for h in helpers
              if not any(f"import {h}" in text or f"from {h} import" in text for text in users.values())]
    assert not unused, f"bench helpers no benchmark imports (dead, or run by nothing in make test): {unused}"
