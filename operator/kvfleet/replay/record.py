"""A replay's record: what the pool did with the trace, in figures that compare with the simulator's.

Written as one JSON file (`record.json`) beside the exact requests sent (`sent.csv`, replayable by
`kvfleet simulate --trace`) and the pool's merged measured speed (`speed-profile.json`, for
`kvfleet simulate --speed-profile`), so that "what would the simulator have said" is one command.
Billed GPU-seconds are the worker pods' lifetimes within the record's window times their GPUs, as
a cloud bills them; GPUs in use and the fluid lower bound are the operator's own status samples.
"""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfleet.api.models import KVMigrationSpec, KVMigrationStatus
from kvfleet.api.speed import SpeedProfile, merge_profiles
from kvfleet.replay.observe import PodLife, Sample, timestamp_s
from kvfleet.replay.streams import Stream
from kvfleet.sim.result import nearest_rank
from kvfleet.sim.traces import TraceRequest

# A request moved again within this many seconds of its last move counts as a re-move (issue: "no
# request is moved again within 30 s unless its worker is draining").
REMOVE_WINDOW_S = 30.0


def percentiles_ms(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99 in ms (the simulator's nearest rank), None for each when there are no values."""
    return {f"p{p}": round(nearest_rank(values, p) * 1000.0, 1) if values else None for p in (50, 90, 99)}


def billed_gpu_seconds(pods: list[PodLife], end_s: float) -> float:
    """Each pod's GPUs times its lifetime inside [0, end_s]."""
    total = 0.0
    for p in pods:
        gone = end_s if p.gone_s is None else min(p.gone_s, end_s)
        total += p.gpus * max(0.0, gone - max(0.0, p.created_s))
    return total


@dataclass(frozen=True)
class MigrationFacts:
    """KVMigrations by mode and phase, why the failed ones failed, and requests moved twice too soon."""

    by_mode_phase: dict[str, int]
    failed: int
    total: int
    failure_causes: dict[str, int]
    quick_removes: int  # moves ordered within REMOVE_WINDOW_S of the request's last successful move, not draining
    succeeded_downtime_ms: dict[str, float | None]
    moves: list[dict[str, Any]]  # one row per KVMigration, oldest first, for a closer look


def migration_facts(migrations: list[dict[str, Any]]) -> MigrationFacts:
    """The facts of the KVMigrations observed, each read through the models the operator and the
    worker write it with (a field renamed there is renamed here, or this fails loudly)."""
    parsed = sorted(((m["metadata"]["name"], m["metadata"].get("creationTimestamp"),
                      KVMigrationSpec.model_validate(m["spec"]), KVMigrationStatus.model_validate(m.get("status") or {}))
                     for m in migrations), key=lambda row: (row[1] or "", row[0]))
    by_mode_phase: Counter[str] = Counter()
    causes: Counter[str] = Counter()
    downtimes: list[float] = []
    moves_of: dict[str, list[tuple[float, str, str]]] = defaultdict(list)  # (created, reason, phase)
    for _, created, spec, status in parsed:
        by_mode_phase[f"{spec.mode}/{status.phase}"] += 1
        if status.phase == "Failed":
            causes[(status.message or "no message")[:160]] += 1
        if status.phase == "Succeeded" and status.downtime_seconds is not None:
            downtimes.append(status.downtime_seconds)
        if created:
            moves_of[spec.request_id].append((timestamp_s(created), spec.reason, status.phase))
    quick = 0
    for moves in moves_of.values():
        moves.sort()
        moved_s: float | None = None  # when it last moved for real (a Succeeded move was ordered)
        for created_s, reason, phase in moves:
            if moved_s is not None and created_s - moved_s < REMOVE_WINDOW_S and reason != "Drain":
                quick += 1
            if phase == "Succeeded":
                moved_s = created_s
    failed = sum(n for key, n in by_mode_phase.items() if key.endswith("/Failed"))
    rows = [{"name": name, "created": created, "request": spec.request_id, "from": spec.source_pod,
             "to": spec.target_pod, "mode": spec.mode, "reason": spec.reason, "phase": status.phase,
             "message": status.message} for name, created, spec, status in parsed]
    return MigrationFacts(dict(sorted(by_mode_phase.items())), failed, len(migrations), dict(causes.most_common()),
                          quick, percentiles_ms(downtimes), rows)


@dataclass(frozen=True)
class Record:
    """Everything a replay wrote, as the JSON carries it."""

    pool: str
    policy: str
    trace: str
    window: str
    time_scale: float
    started_wall_s: float  # when the replay's clock read 0, as Unix seconds: every *_s below counts from it
    duration_s: float
    streams: int
    streams_whole: int
    not_whole: list[str]
    billed_gpu_seconds: float
    gpu_seconds_in_use: float
    peak_gpus_in_use: int
    peak_workers: int
    mean_lower_bound_gpus: float
    pods: list[PodLife]
    samples: list[Sample]
    migrations: MigrationFacts
    ttft_ms: dict[str, float | None]
    per_token_ms: dict[str, float | None]
    pod_ready_s: dict[str, float | None]
    speed_profile_workers: int
    # From the delete call to the pod gone (its shutdown, the kubelet's final delete): billed after the
    # scale-down delay, so the simulator adds it to the delay (bench/sim_vs_live.py).
    pod_stop_s: dict[str, float | None] = field(default_factory=dict)
    # Each stream from its send to its last token (its job completion time), and when the last one
    # ended: where the simulator's timing and the pool's part (bench/sim_vs_live.py prints both).
    jct_ms: dict[str, float | None] = field(default_factory=dict)
    last_stream_end_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "pool": self.pool, "policy": self.policy, "trace": self.trace, "window": self.window,
            "timeScale": self.time_scale, "startedAtUnixSeconds": round(self.started_wall_s, 3),
            "durationSeconds": round(self.duration_s, 3),
            "streams": self.streams, "streamsWhole": self.streams_whole, "notWhole": self.not_whole,
            "billedGpuSeconds": round(self.billed_gpu_seconds, 3),
            "gpuSecondsInUse": round(self.gpu_seconds_in_use, 3),
            "peakGpusInUse": self.peak_gpus_in_use, "peakWorkers": self.peak_workers,
            "meanLowerBoundGpus": round(self.mean_lower_bound_gpus, 3),
            "migrations": {"total": self.migrations.total, "failed": self.migrations.failed,
                           "byModeAndPhase": self.migrations.by_mode_phase,
                           "failureCauses": self.migrations.failure_causes,
                           "movedAgainWithin30s": self.migrations.quick_removes,
                           "succeededDowntimeMs": self.migrations.succeeded_downtime_ms,
                           "moves": self.migrations.moves},
            "ttftMs": self.ttft_ms, "perTokenMs": self.per_token_ms, "podReadySeconds": self.pod_ready_s,
            "podStopSeconds": self.pod_stop_s, "jctMs": self.jct_ms,
            "lastStreamEndSeconds": None if self.last_stream_end_s is None else round(self.last_stream_end_s, 3),
            "speedProfileWorkers": self.speed_profile_workers,
            "pods": [{"name": p.name, "uid": p.uid, "gpus": p.gpus, "createdSeconds": round(p.created_s, 3),
                      "readySeconds": None if p.ready_s is None else round(p.ready_s, 3),
                      "goneSeconds": None if p.gone_s is None else round(p.gone_s, 3),
                      "deletedSeconds": None if p.deleted_s is None else round(p.deleted_s, 3)} for p in self.pods],
            "samples": [[round(s.at_s, 2), s.gpus_in_use, s.lower_bound_gpus, s.workers, s.streams_in_flight]
                        for s in self.samples],
        }


def build_record(*, pool: str, policy: str, trace: str, window: str, time_scale: float, started_wall_s: float,
                 end_s: float,
                 streams: list[Stream], pods: list[PodLife], samples: list[Sample],
                 migrations: list[dict[str, Any]], profiles: dict[str, SpeedProfile]) -> Record:
    not_whole = [f"{s.request.request_id}: {s.tokens}/{s.max_tokens} tokens, finish {s.finish_reason}, {s.error}"
                 for s in streams if not s.whole]
    # GPU-seconds in use: each status sample stands for the time until the next one.
    in_use = sum(a.gpus_in_use * (b.at_s - a.at_s) for a, b in zip(samples, samples[1:]))
    readies = [p.ready_s - p.created_s for p in pods if p.ready_s is not None and p.created_s >= 0]
    stops = [p.gone_s - p.deleted_s for p in pods if p.gone_s is not None and p.deleted_s is not None]
    return Record(
        pool=pool, policy=policy, trace=trace, window=window, time_scale=time_scale, started_wall_s=started_wall_s,
        duration_s=end_s,
        streams=len(streams), streams_whole=len(streams) - len(not_whole), not_whole=not_whole,
        billed_gpu_seconds=billed_gpu_seconds(pods, end_s), gpu_seconds_in_use=in_use,
        peak_gpus_in_use=max((s.gpus_in_use for s in samples), default=0),
        peak_workers=max((s.workers for s in samples), default=0),
        mean_lower_bound_gpus=sum(s.lower_bound_gpus for s in samples) / len(samples) if samples else 0.0,
        pods=sorted(pods, key=lambda p: p.created_s), samples=samples, migrations=migration_facts(migrations),
        ttft_ms=percentiles_ms([t for s in streams if (t := s.ttft_s) is not None]),
        per_token_ms=percentiles_ms([t for s in streams if (t := s.per_token_s) is not None]),
        pod_ready_s={"median": nearest_rank(readies, 50) if readies else None, "max": max(readies, default=None)},
        pod_stop_s={"median": nearest_rank(stops, 50) if stops else None, "max": max(stops, default=None)},
        speed_profile_workers=len(profiles),
        jct_ms=percentiles_ms([s.ended_s - s.sent_s for s in streams if s.ended_s is not None]),
        last_stream_end_s=max((s.ended_s for s in streams if s.ended_s is not None), default=None),
    )


def write_sent_csv(path: Path, requests: list[tuple[float, TraceRequest]]) -> None:
    """The requests as sent: when (s since the replay began), prompt and output tokens; `kvfleet
    simulate --trace` reads this format (timestamp in seconds, prompt, output)."""
    lines = ["timestamp,prompt,output"]
    lines += [f"{at_s:.3f},{r.prompt_tokens},{r.output_tokens}" for at_s, r in requests]
    path.write_text("\n".join(lines) + "\n")


def write_record(out_dir: Path, record: Record, sent: list[tuple[float, TraceRequest]],
                 profiles: dict[str, SpeedProfile]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "record.json", out_dir / "sent.csv"]
    written[0].write_text(json.dumps(record.to_json(), indent=1) + "\n")
    write_sent_csv(written[1], sent)
    if profiles:
        try:
            merged = merge_profiles(profiles.values())
        except ValueError as err:  # workers of different engines, models or C (a rollout mid-replay)
            print(f"no speed-profile.json: {err}", file=sys.stderr)
        else:
            path = out_dir / "speed-profile.json"
            path.write_text(merged.model_dump_json(by_alias=True, indent=1) + "\n")
            written.append(path)
    return written
