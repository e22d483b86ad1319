"""The report of `kvfleet simulate --disaggregation`: disaggregated pools beside colocated serving.

The question it answers is how many prefill and decode GPUs a trace needs, against colocated
serving, so each workload's table puts the colocated replay of the same trace (run.py, under the same
policy, with or without the prefix cache model) above one row per disaggregated split and caching
mode, with the same columns: GPUs, GPU-seconds, TTFT and JCT, KV sent between roles, cache hits per
role. The colocated pool is elastic (its GPUs are what the policy held; `gpus` is their peak), a
disaggregated one is provisioned (`gpus` is P + D, held the whole run). Kept apart from report.py so
that the outputs without `--disaggregation` stay exactly as they were.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import dataclass

from kvfleet.sim.disaggregation import DisaggResult
from kvfleet.sim.result import RunResult, nearest_rank

MIB = 1 << 20


@dataclass(frozen=True)
class PdComparison:
    """One workload on one setup: its colocated replays (no cache, prefix cache) and disaggregated runs."""

    setup: str
    workload: str
    num_requests: int
    colocated: tuple[RunResult, ...]
    disaggregated: tuple[DisaggResult, ...]

    def to_json(self) -> dict[str, object]:
        return {
            "setup": self.setup,
            "workload": self.workload,
            "num_requests": self.num_requests,
            "colocated": {_caching_label(r): colocated_stats(r) for r in self.colocated},
            "disaggregated": [disagg_stats(d) for d in self.disaggregated],
        }


def _caching_label(r: RunResult) -> str:
    return "prefix" if r.prefix_cache else "none"


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def colocated_stats(r: RunResult) -> dict[str, object]:
    stats: dict[str, object] = {
        "policy": r.policy,
        "peak_gpus": r.peak_gpus,
        "mean_gpus": round(r.mean_gpus, 4),
        "busy_gpu_s": round(r.active_gpu_hours * 3600.0, 3),
        "held_gpu_s": round(r.billed_gpu_hours * 3600.0, 3),
        "ttft_mean_s": round(_mean(r.ttfts_s), 4),
        "ttft_p99_s": round(nearest_rank(r.ttfts_s, 99), 4),
        "jct_mean_s": round(_mean(r.jcts_s), 4),
        "jct_p99_s": round(nearest_rank(r.jcts_s, 99), 4),
        "num_preemptions": r.num_preemptions,
        "duration_s": r.duration_s,
    }
    if r.prefix_cache:
        stats.update(prompt_tokens=r.prompt_tokens, prefix_hit_tokens=r.prefix_hit_tokens)
    return stats


def disagg_stats(d: DisaggResult) -> dict[str, object]:
    return {
        "split": d.split.name,
        "prefill_gpus": d.split.prefill_gpus,
        "decode_gpus": d.split.decode_gpus,
        "caching": str(d.caching),
        "policy": d.policy,
        "link_bytes_per_s": d.link_bytes_per_s,
        "decode_gpus_peak": d.decode_gpus_peak,
        "decode_gpus_mean": round(d.decode_gpus_mean, 4),
        "decode_over_cap_epochs": d.decode_over_cap_epochs,
        "decode_preemptions": d.decode_preemptions,
        "prefill_utilization": round(d.prefill_utilization, 4),
        "busy_gpu_s": round(d.busy_gpu_s, 3),
        "held_gpu_s": round(d.held_gpu_s, 3),
        "ttft_mean_s": round(d.ttft_mean_s, 4),
        "ttft_p99_s": round(d.ttft_p99_s, 4),
        "jct_mean_s": round(d.jct_mean_s, 4),
        "jct_p99_s": round(d.jct_p99_s, 4),
        "decode_wait_p99_s": round(nearest_rank(d.decode_waits_s, 99), 4),
        "transfer_bytes": d.transfer_bytes,
        "mean_transfer_bytes": round(d.mean_transfer_bytes, 1),
        "return_bytes": d.return_bytes,
        "prompt_tokens": d.prompt_tokens,
        "prefill_hit_tokens": d.prefill_hit_tokens,
        "decode_hit_tokens": d.decode_hit_tokens,
        "prefill_evictions": d.prefill_evictions,
        "decode_evictions": d.decode_evictions,
        "num_migrations": d.num_migrations,
        "capacity_violations": d.capacity_violations,
        "duration_s": d.duration_s,
    }


HEADER = ("setup", "workload", "serving", "caching", "gpus", "decode_peak", "decode_mean", "busy_gpu_s",
          "held_gpu_s", "ttft_mean_s", "ttft_p99_s", "jct_mean_s", "jct_p99_s", "xfer_mib_per_req",
          "prefill_hit_tokens", "decode_hit_tokens", "preemptions")


def rows(comparisons: Sequence[PdComparison], digits: int = 2) -> list[tuple[str, ...]]:
    """One row per colocated replay and per disaggregated run. Colocated rows: `gpus` and
    `decode_peak` are the peak GPUs the policy held (they prefill and decode), `held_gpu_s` what their
    pods were billed; no KV crosses between roles (`-`)."""
    out: list[tuple[str, ...]] = []
    f = f"{{:.{digits}f}}"
    for cmp in comparisons:
        for r in cmp.colocated:
            out.append((cmp.setup, cmp.workload, "colocated", "prefix" if r.prefix_cache else "none", str(r.peak_gpus),
                        str(r.peak_gpus), f.format(r.mean_gpus), f.format(r.active_gpu_hours * 3600.0),
                        f.format(r.billed_gpu_hours * 3600.0), f.format(_mean(r.ttfts_s)),
                        f.format(nearest_rank(r.ttfts_s, 99)), f.format(_mean(r.jcts_s)),
                        f.format(nearest_rank(r.jcts_s, 99)), "-",
                        str(r.prefix_hit_tokens) if r.prefix_cache else "-", "-", str(r.num_preemptions)))
        for d in cmp.disaggregated:
            out.append((cmp.setup, cmp.workload, d.split.name, str(d.caching), str(d.split.total_gpus),
                        str(d.decode_gpus_peak), f.format(d.decode_gpus_mean), f.format(d.busy_gpu_s),
                        f.format(d.held_gpu_s), f.format(d.ttft_mean_s), f.format(d.ttft_p99_s),
                        f.format(d.jct_mean_s), f.format(d.jct_p99_s), f.format(d.mean_transfer_bytes / MIB),
                        str(d.prefill_hit_tokens), str(d.decode_hit_tokens), str(d.decode_preemptions)))
    return out


def table(comparisons: Sequence[PdComparison]) -> str:
    body = rows(comparisons)
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(HEADER)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(HEADER, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in body]
    return "\n".join(lines)


def to_csv(comparisons: Sequence[PdComparison]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(HEADER)
    writer.writerows(rows(comparisons, digits=4))
    return buf.getvalue()


def to_json(comparisons: Sequence[PdComparison]) -> dict[str, object]:
    """`comparisons` lists every workload; with one, its fields are also at the top level (as the
    plain `simulate --json` does with one scenario)."""
    payload: dict[str, object] = {"comparisons": [c.to_json() for c in comparisons]}
    if len(comparisons) == 1:
        payload.update(comparisons[0].to_json())
    return payload
