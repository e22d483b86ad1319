"""Turning simulation results into the summary table, CSV, JSON and the paper-style figures.

Figures follow MELL §VIII-C: GPUs needed per policy and workload (Fig. 11), migration frequency
(Fig. 12), GPU memory utilization (Fig. 14), and GPUs in use over time (Fig. 15). matplotlib is
imported only when plots are asked for.

Bounds: each policy is set against its own fluid bound (the KV its run held) and against one bound
shared by every policy of a scenario, computed from the workload alone (`SharedBound`); no policy's
run serves as the others' reference.

With the prefix cache model (`--prefix-cache`) every output also says, per policy, how much of the
prompts the workers held (hit ratio) and how many prompt tokens were not prefilled; without it the
outputs are exactly as before (no columns or keys are added), so existing results compare unchanged.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvfleet.sim.bounds import SharedBound
from kvfleet.sim.result import RunResult

POLICY_LABELS = {"mell": "MELL", "mell-paper": "MELL-paper", "bf": "BF", "wf": "WF", "lb": "LB"}


@dataclass(frozen=True)
class Scenario:
    """One workload under one setup, run under every policy."""

    setup: str
    workload: str
    capacity_bytes: int
    results: tuple[RunResult, ...]

    @property
    def shared_bound(self) -> SharedBound:
        """The workload's bound: every run computed the same one (same requests, setup, epoch)."""
        return self.results[0].shared_bound if self.results else SharedBound()

    @property
    def num_requests(self) -> int:
        return self.results[0].num_requests if self.results else 0

    @property
    def duration_s(self) -> float:
        """Until the last policy's run drained."""
        return max((r.duration_s for r in self.results), default=0.0)

    def to_json(self) -> dict[str, object]:
        policies: dict[str, object] = {}
        for r in self.results:
            stats: dict[str, object] = {
                "peak_gpus": r.peak_gpus,
                "mean_gpus": round(r.mean_gpus, 4),
                "utilization": round(r.utilization, 4),
                "migrations_per_s": round(r.migrations_per_s, 4),
                "migrated_bytes": r.migrated_bytes,
                "item_moves_per_s": round(r.num_item_moves / r.duration_s, 4) if r.duration_s else 0.0,
                "preemptions_per_s": round(r.num_preemptions / r.duration_s, 4) if r.duration_s else 0.0,
                "kv_transfers": r.num_kv_transfers,
                "token_transfers": r.num_token_transfers,
                "deferred_migrations": r.num_deferred,
                "max_moves_per_operation": r.max_moves_per_operation,
                "capacity_violations": r.num_capacity_violations,
                "lower_bound_peak": r.lower_bound_peak,
                "lower_bound_mean": round(r.lower_bound_mean, 4),
                "duration_s": r.duration_s,
                "active_gpu_hours": round(r.active_gpu_hours, 6),
                "billed_gpu_hours": round(r.billed_gpu_hours, 6),
                "peak_pods": r.peak_pods,
                "queue_p50_s": round(r.queue_p50_s, 4),
                "queue_p99_s": round(r.queue_p99_s, 4),
                "tpot_p50_ms": round(r.tpot_p50_ms, 4),
                "tpot_p99_ms": round(r.tpot_p99_ms, 4),
                **{f"{name}_p{q}_s": round(of(q), 4) for name, of in (("ttft", r.ttft_s), ("jct", r.jct_s))
                   for q in (50, 90, 99)},
                "last_finish_s": round(r.last_finish_s, 4),
                "num_over_capacity_requests": r.num_over_capacity_requests,
                "num_spanning": r.num_spanning,
                "shared_bound_peak": r.shared_bound.peak,
                "shared_bound_mean": round(r.shared_bound.mean, 4),
                "shared_bound_gpu_hours": round(r.shared_bound.gpu_hours, 6),
                "mean_vs_own_bound": round(r.mean_vs_own_bound, 4),
                "own_bound_billed_gpu_hours": round(r.own_bound_billed_gpu_hours, 6),
                "num_migrations": r.num_migrations,
                "num_preemptions": r.num_preemptions,
                "active_vs_shared_bound": round(r.active_vs_shared_bound, 4),
                "billed_vs_shared_bound": round(r.billed_vs_shared_bound, 4),
                "scale_up_s": r.scale_up_s,
                "scale_down_delay_s": r.scale_down_delay_s,
                "batching": r.batching,
            }
            if r.prefix_cache:
                stats.update(prefix_stats(r))
            policies[r.policy] = stats
        bound = self.shared_bound
        return {
            "setup": self.setup,
            "workload": self.workload,
            "capacity_bytes": self.capacity_bytes,
            "num_requests": self.num_requests,
            "duration_s": self.duration_s,
            "policies": policies,
            "shared_bound_peak": bound.peak,
            "shared_bound_mean": round(bound.mean, 4),
            "shared_bound_gpu_hours": round(bound.gpu_hours, 6),
            "shared_bound_duration_s": bound.duration_s,
        }


def prefix_stats(r: RunResult) -> dict[str, object]:
    """What the prefix cache model did in one run (only for a run with it on)."""
    return {
        "prefix_cache": True,
        "prompt_tokens": r.prompt_tokens,
        "prefix_hit_tokens": r.prefix_hit_tokens,
        "prefix_host_hit_tokens": r.prefix_host_hit_tokens,
        "prefix_hit_ratio": round(r.prefix_hit_ratio, 4),
        "prefill_tokens_saved": r.prefill_tokens_saved,
        "num_prefix_hits": r.num_prefix_hits,
        "num_prefix_evictions": r.num_prefix_evictions,
        "shared_same_gpu_ratio": round(r.shared_same_gpu_ratio, 4),
        "shared_pool_ratio": round(r.shared_pool_ratio, 4),
    }


def _with_prefix(scenarios: Sequence[Scenario]) -> bool:
    return any(r.prefix_cache for sc in scenarios for r in sc.results)


# Added to the table and the CSV when a run modelled the prefix cache.
PREFIX_HEADER = ("prefix_hit", "prefill_saved_tokens")


def _prefix_cells(r: RunResult) -> tuple[str, ...]:
    return (f"{r.prefix_hit_ratio:.1%}", str(r.prefill_tokens_saved)) if r.prefix_cache else ("-", "-")


def _prefix_csv_cells(r: RunResult) -> tuple[str, ...]:
    return (f"{r.prefix_hit_ratio:.4f}", str(r.prefill_tokens_saved)) if r.prefix_cache else ("", "")


# The table: what fits on a screen. lb_* is the policy's own fluid bound, shared_lb_* the workload's.
HEADER = ("setup", "workload", "policy", "peak_gpus", "mean_gpus", "utilization", "migrations_per_s",
          "preemptions_per_s", "migrated_gib", "lb_peak", "lb_mean", "billed_gpu_h", "queue_p99_s", "tpot_p99_ms",
          "shared_lb_mean", "shared_lb_gpu_h")
# The CSV: everything per run.
CSV_HEADER = ("setup", "workload", "policy", "peak_gpus", "mean_gpus", "utilization", "migrations_per_s",
              "preemptions_per_s", "migrated_gib", "lb_peak", "lb_mean", "active_gpu_hours", "billed_gpu_hours",
              "peak_pods", "queue_p50_s", "queue_p99_s", "tpot_p50_ms", "tpot_p99_ms", "num_over_capacity_requests",
              "num_spanning", "shared_lb_peak", "shared_lb_mean", "shared_lb_gpu_hours", "mean_vs_own_bound",
              "billed_vs_shared_bound", "scale_up_s", "scale_down_delay_s")


def rows(scenarios: Sequence[Scenario]) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    with_prefix = _with_prefix(scenarios)
    for sc in scenarios:
        bound = sc.shared_bound
        for r in sc.results:
            pre = r.num_preemptions / r.duration_s if r.duration_s else 0.0
            out.append((sc.setup, sc.workload, POLICY_LABELS.get(r.policy, r.policy), str(r.peak_gpus),
                        f"{r.mean_gpus:.2f}", f"{r.utilization:.1%}", f"{r.migrations_per_s:.3f}", f"{pre:.3f}",
                        f"{r.migrated_bytes / 2**30:.1f}", str(r.lower_bound_peak), f"{r.lower_bound_mean:.2f}",
                        f"{r.billed_gpu_hours:.3f}", f"{r.queue_p99_s:.2f}", f"{r.tpot_p99_ms:.1f}",
                        f"{bound.mean:.2f}", f"{bound.gpu_hours:.3f}", *(_prefix_cells(r) if with_prefix else ())))
    return out


def table(scenarios: Sequence[Scenario]) -> str:
    body = rows(scenarios)
    header = HEADER + PREFIX_HEADER if _with_prefix(scenarios) else HEADER
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    for r in body:
        lines.append("  ".join(v.ljust(w) for v, w in zip(r, widths)))
    return "\n".join(lines)


def to_csv(scenarios: Sequence[Scenario]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    with_prefix = _with_prefix(scenarios)
    writer.writerow(CSV_HEADER + PREFIX_HEADER if with_prefix else CSV_HEADER)
    for sc in scenarios:
        bound = sc.shared_bound
        for r in sc.results:
            pre = r.num_preemptions / r.duration_s if r.duration_s else 0.0
            writer.writerow((sc.setup, sc.workload, r.policy, r.peak_gpus, f"{r.mean_gpus:.4f}",
                             f"{r.utilization:.4f}", f"{r.migrations_per_s:.4f}", f"{pre:.4f}",
                             f"{r.migrated_bytes / 2**30:.4f}", r.lower_bound_peak, f"{r.lower_bound_mean:.4f}",
                             f"{r.active_gpu_hours:.6f}", f"{r.billed_gpu_hours:.6f}", r.peak_pods,
                             f"{r.queue_p50_s:.4f}", f"{r.queue_p99_s:.4f}", f"{r.tpot_p50_ms:.4f}",
                             f"{r.tpot_p99_ms:.4f}", r.num_over_capacity_requests, r.num_spanning, bound.peak,
                             f"{bound.mean:.4f}", f"{bound.gpu_hours:.6f}", f"{r.mean_vs_own_bound:.4f}",
                             f"{r.billed_vs_shared_bound:.4f}", r.scale_up_s, r.scale_down_delay_s,
                             *(_prefix_csv_cells(r) if with_prefix else ())))
    return buf.getvalue()


def plot(scenarios: Sequence[Scenario], out_dir: Path) -> list[Path]:
    """Write fig11_gpus.png, fig12_migrations.png, fig14_utilization.png and fig15_timeline_*.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    setups = list(dict.fromkeys(sc.setup for sc in scenarios))
    policies = list(dict.fromkeys(r.policy for sc in scenarios for r in sc.results))

    def bars(metric: str, ylabel: str, fname: str, value: Callable[[RunResult], float]) -> None:
        fig, axes = plt.subplots(1, len(setups), figsize=(6 * len(setups), 4), squeeze=False)
        for ax, setup in zip(axes[0], setups):
            scs = [sc for sc in scenarios if sc.setup == setup]
            width = 0.8 / max(1, len(policies))
            for k, pol in enumerate(policies):
                xs, ys = [], []
                for i, sc in enumerate(scs):
                    for r in sc.results:
                        if r.policy == pol:
                            xs.append(i + k * width)
                            ys.append(value(r))
                ax.bar(xs, ys, width, label=POLICY_LABELS.get(pol, pol))
            if metric == "gpus":
                for i, sc in enumerate(scs):
                    ax.hlines(sc.shared_bound.peak, i - width / 2, i + 0.8 - width / 2, colors="black",
                              linestyles="dashed", label="shared bound (peak, a reference)" if i == 0 else None)
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(scs))])
            ax.set_xticklabels([sc.workload for sc in scs], rotation=20)
            ax.set_ylabel(ylabel)
            ax.set_title(setup)
            ax.legend(fontsize="small")
        fig.tight_layout()
        path = out_dir / fname
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    bars("gpus", "peak GPUs needed", "fig11_gpus.png", lambda r: float(r.peak_gpus))
    bars("migrations", "migrations per second", "fig12_migrations.png", lambda r: r.migrations_per_s)
    bars("utilization", "GPU KV memory utilization", "fig14_utilization.png", lambda r: r.utilization)
    for sc in scenarios:
        fig, ax = plt.subplots(figsize=(8, 4))
        for r in sc.results:
            ax.plot(r.times_s, r.gpus, label=POLICY_LABELS.get(r.policy, r.policy), linewidth=1)
        ax.axhline(sc.shared_bound.mean, label="shared bound (mean)", color="black", linestyle="dashed", linewidth=1)
        ax.set_xlabel("time (s)")
        ax.set_ylabel("GPUs in use")
        ax.set_title(f"{sc.setup}, {sc.workload}")
        ax.legend(fontsize="small")
        fig.tight_layout()
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in f"{sc.setup}_{sc.workload}")
        path = out_dir / f"fig15_timeline_{safe}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
