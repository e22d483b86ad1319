"""Workloads for the simulator: real traces from files, and the paper's synthetic Poisson workloads.

Readers accept the Azure LLM inference trace CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`, wall
clock timestamps), any CSV with timestamp / prompt / output columns, and JSONL with `timestamp`
(milliseconds), `input_length`, `output_length`; other columns and fields are ignored. A JSONL line may
also carry `hash_ids`, the Mooncake trace's prompt block hashes (one int per `hash_block_tokens` block
of the prompt, in prompt order; equal ids mean equal blocks): the simulator's prefix cache model
matches them (MemServe §4.2). CSV traces have none. JSONL may be gzip-compressed (`.jsonl.gz`,
`.ndjson.gz`, `.json.gz`), as kvfleet ships Mooncake's trace, and is decompressed in memory. A bad
file raises TraceError naming file and line: a trace with no requests, a length that is not a whole
number >= 0, a timestamp that cannot be read, `hash_ids` that are not a list of ints or name more
blocks than the prompt has, an unreadable gzip, and (with `max_context_tokens`) a request whose
prompt and output exceed the model's context. Documented handling, not errors: rows out of time
order are replayed in time order (ties keep the file's order: duplicate timestamps are simultaneous
arrivals), timestamps are re-based so the first request arrives at 0, and a length of 0 counts as 1
token.

The Poisson workloads follow MELL §VIII-B: arrivals at lambda 0.5 / 0.8 / 1.1 requests per second and
conversation lengths like LMSYS-Chat-1M and WildChat, scaled up ten times. The datasets are not
shipped; their published means (LMSYS-Chat-1M: 69.5 prompt / 214.5 response tokens; WildChat: 295.6
/ 441.3) drive log-normal lengths, cut at LLaMA-2's 4096-token context before scaling.
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import random
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


# Mooncake's traces hash prompts in blocks of 512 tokens.
DEFAULT_HASH_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRequest:
    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    # One id per prompt block of the trace's hash block size, from the first block; may cover only
    # a leading part of the prompt (or none: empty, as in every CSV and synthetic workload).
    hash_ids: tuple[int, ...] = ()

    def hashed_tokens(self, hash_block_tokens: int) -> int:
        """Prompt tokens that `hash_ids` cover: whole blocks, the last one cut at the prompt's end."""
        return min(self.prompt_tokens, len(self.hash_ids) * hash_block_tokens)


_TIME_COLS = ("timestamp", "time", "arrival", "arrival_time", "arrival_s")
_PROMPT_COLS = ("contexttokens", "input_length", "prompt_tokens", "prompt", "input_tokens", "prompt_length")
_OUTPUT_COLS = ("generatedtokens", "output_length", "output_tokens", "output", "completion_tokens", "response_length")


def _parse_time(value: str, path: Path, line: int) -> tuple[float, bool]:
    """Seconds, and whether the value was wall-clock (Azure) rather than a number."""
    text = value.strip()
    try:
        return float(text), False
    except ValueError:
        pass
    try:
        # Azure writes 7 fractional digits; datetime takes at most 6.
        if "." in text:
            head, frac = text.split(".", 1)
            text = f"{head}.{frac[:6]}"
        return datetime.fromisoformat(text).timestamp(), True
    except ValueError as err:
        raise TraceError(f"{path}:{line}: cannot read timestamp {value!r}") from err


def _parse_tokens(value: str, what: str, path: Path, line: int) -> int:
    try:
        number = float(value)
    except ValueError as err:
        raise TraceError(f"{path}:{line}: {what} {value!r} is not a number") from err
    if number < 0 or not math.isfinite(number) or number != int(number):
        raise TraceError(f"{path}:{line}: {what} {value!r} must be a whole number >= 0")
    return int(number)


# (time, prompt tokens, output tokens, line, hash ids) of one request as read.
_Row = tuple[float, int, int, int, tuple[int, ...]]


def _finish(rows: list[_Row], path: Path, max_context_tokens: int | None) -> list[TraceRequest]:
    """Requests in time order (a stable sort: ties keep the file's order) from (time, prompt, output, line, hashes)."""
    if not rows:
        raise TraceError(f"{path}: no requests in the trace")
    if max_context_tokens is not None:
        for _, prompt, output, line, _ in rows:
            prompt, output = max(1, prompt), max(1, output)  # as replayed: a length of 0 counts as 1
            if prompt + output > max_context_tokens:
                raise TraceError(f"{path}:{line}: prompt {prompt} + output {output} tokens exceed the model's context "
                                 f"of {max_context_tokens} tokens")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return [
        TraceRequest(f"r{i}", t - t0, max(1, prompt), max(1, output), hashes)
        for i, (t, prompt, output, _, hashes) in enumerate(rows)
    ]


def read_csv(path: Path, time_unit_s: float | None = None, max_context_tokens: int | None = None) -> list[TraceRequest]:
    """Azure CSV or any CSV with timestamp/prompt/output columns (numeric timestamps in seconds
    unless `time_unit_s` says otherwise; wall-clock timestamps are accepted too)."""
    try:
        handle = path.open(newline="", encoding="utf-8")
    except OSError as err:
        raise TraceError(f"{path}: cannot open: {err.strerror}") from err
    with handle:
        reader = csv.reader(handle)
        try:
            header = next(reader)
        except StopIteration:
            raise TraceError(f"{path}: empty file") from None
        except (csv.Error, UnicodeDecodeError) as err:
            raise TraceError(f"{path}:1: not a CSV file: {err}") from err
        names = [h.strip().lower() for h in header]

        def column(options: tuple[str, ...], what: str) -> int:
            for option in options:
                if option in names:
                    return names.index(option)
            raise TraceError(f"{path}:1: no {what} column (expected one of {', '.join(options)}; found {', '.join(header)})")

        ti, pi, oi = column(_TIME_COLS, "timestamp"), column(_PROMPT_COLS, "prompt"), column(_OUTPUT_COLS, "output")
        rows: list[_Row] = []
        try:
            for line, record in enumerate(reader, start=2):
                if not record or all(not f.strip() for f in record):
                    continue
                if len(record) <= max(ti, pi, oi):
                    raise TraceError(f"{path}:{line}: expected {len(header)} fields, found {len(record)}")
                t, wall = _parse_time(record[ti], path, line)
                if not wall and time_unit_s is not None:
                    t *= time_unit_s
                rows.append((t, _parse_tokens(record[pi], "prompt", path, line),
                             _parse_tokens(record[oi], "output", path, line), line, ()))
        except (csv.Error, UnicodeDecodeError) as err:
            raise TraceError(f"{path}: not a readable CSV: {err}") from err
    return _finish(rows, path, max_context_tokens)


def _parse_hash_ids(value: object, prompt_tokens: int, hash_block_tokens: int, path: Path, line: int) -> tuple[int, ...]:
    """A Mooncake `hash_ids` list: ints only (a bool or 3.0 is refused: an id is not a measure), and no
    more blocks than the prompt has (ceil(prompt / block); a length of 0 counts as 1 token, as replayed)."""
    if not isinstance(value, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in value):
        raise TraceError(f"{path}:{line}: hash_ids must be a list of integers")
    max_blocks = math.ceil(max(1, prompt_tokens) / hash_block_tokens)
    if len(value) > max_blocks:
        raise TraceError(f"{path}:{line}: {len(value)} hash_ids for a prompt of {prompt_tokens} tokens, which has "
                         f"{max_blocks} blocks of {hash_block_tokens} tokens (see --hash-block-tokens)")
    return tuple(value)


_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")


def _is_gzip(path: Path) -> bool:
    return path.suffix.lower() == ".gz"


def _is_jsonl(path: Path) -> bool:
    """By suffix, under a `.gz` if there is one (`t.jsonl.gz` is JSONL, gzip-compressed)."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes.pop()
    return bool(suffixes) and suffixes[-1] in _JSONL_SUFFIXES


def _read_text(path: Path) -> str:
    """The file's text, gunzipped first if its name ends in `.gz`. In memory: the traces are a few MB
    decompressed, and a whole-file read keeps a truncated gzip an error before any line is parsed."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise TraceError(f"{path}: cannot open: {err.strerror}") from err
    if _is_gzip(path):
        # BadGzipFile (an OSError) for a bad header, EOFError for a truncated stream, zlib.error for
        # corrupt deflate data.
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as err:
            raise TraceError(f"{path}: not a readable gzip file: {err}") from err
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise TraceError(f"{path}: not UTF-8 text") from err


def read_jsonl(path: Path, max_context_tokens: int | None = None,
               hash_block_tokens: int = DEFAULT_HASH_BLOCK_TOKENS) -> list[TraceRequest]:
    """JSONL: one object per line with `timestamp` (ms), `input_length`, `output_length`, optionally
    `hash_ids` (prompt block hashes, `hash_block_tokens` tokens a block); gzip-compressed if the name
    ends in `.gz`."""
    if hash_block_tokens <= 0:
        raise TraceError(f"hash block of {hash_block_tokens} tokens: must be positive")
    lines = _read_text(path).splitlines()
    rows: list[_Row] = []
    for line, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as err:
            raise TraceError(f"{path}:{line}: not JSON: {err.msg}") from err
        if not isinstance(obj, dict):
            raise TraceError(f"{path}:{line}: expected an object")
        for key in ("timestamp", "input_length", "output_length"):
            if key not in obj:
                raise TraceError(f"{path}:{line}: missing field {key!r}")
        ts = obj["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
            raise TraceError(f"{path}:{line}: timestamp must be a number of milliseconds")
        prompt = _parse_tokens(str(obj["input_length"]), "input_length", path, line)
        hashes = _parse_hash_ids(obj["hash_ids"], prompt, hash_block_tokens, path, line) if "hash_ids" in obj else ()
        rows.append((float(ts) / 1000.0, prompt, _parse_tokens(str(obj["output_length"]), "output_length", path, line),
                     line, hashes))
    return _finish(rows, path, max_context_tokens)


def read_trace(path: Path, max_context_tokens: int | None = None,
               hash_block_tokens: int = DEFAULT_HASH_BLOCK_TOKENS) -> list[TraceRequest]:
    """A trace file by its suffix (.jsonl/.ndjson/.json, each optionally .gz: JSONL; anything else:
    CSV); see the module doc."""
    if not path.exists():
        raise TraceError(f"{path}: no such file")
    if _is_jsonl(path):
        return read_jsonl(path, max_context_tokens, hash_block_tokens)
    if _is_gzip(path):
        # The CSV reader would fail on the compressed bytes with a message about CSV, not the cause.
        raise TraceError(f"{path}: only JSONL traces may be gzip-compressed (.jsonl.gz, .ndjson.gz, .json.gz)")
    return read_csv(path, max_context_tokens=max_context_tokens)


# ---- synthetic workloads (§VIII-B) ----

# (prompt mean, prompt sigma, output mean, output sigma) of log-normal token counts.
LENGTH_PROFILES: dict[str, tuple[float, float, float, float]] = {
    "lmsys": (69.5, 1.1, 214.5, 0.9),
    "wildchat": (295.6, 1.2, 441.3, 0.8),
}
MAX_CONTEXT_TOKENS = 4096


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)


def poisson_workload(
    rate_per_s: float,
    duration_s: float,
    lengths: str = "mixed",
    scale: float = 10.0,
    seed: int = 0,
) -> list[TraceRequest]:
    """Poisson arrivals; lengths from `lmsys`, `wildchat` or `mixed` (each request picks one at random)."""
    if rate_per_s <= 0 or duration_s <= 0:
        raise ValueError("rate and duration must be positive")
    profiles = list(LENGTH_PROFILES) if lengths == "mixed" else [lengths]
    for name in profiles:
        if name not in LENGTH_PROFILES:
            raise ValueError(f"unknown length profile {lengths!r} (lmsys, wildchat, mixed)")
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    for t in _arrivals(rng, rate_per_s, duration_s):
        pm, ps, om, osg = LENGTH_PROFILES[profiles[rng.randrange(len(profiles))]]
        prompt, output = _within_context(_lognormal(rng, pm, ps), _lognormal(rng, om, osg), MAX_CONTEXT_TOKENS)
        out.append(TraceRequest(f"r{len(out)}", t, round(prompt * scale), round(output * scale)))
    return out


def _arrivals(rng: random.Random, rate_per_s: float, duration_s: float) -> Iterator[float]:
    """Poisson arrival times in (0, duration_s]; the caller draws each request's lengths in between,
    so the random stream (and every seeded workload) is the same as one loop drawing both."""
    t = 0.0
    while True:
        t += rng.expovariate(rate_per_s)
        if t > duration_s:
            return
        yield t


def _within_context(prompt: float, output: float, context_tokens: int) -> tuple[int, int]:
    """Whole token counts of at least 1, the prompt cut to leave one output token, the output to the rest."""
    p = min(max(1, round(prompt)), context_tokens - 1)
    return p, min(max(1, round(output)), context_tokens - p)


# A long-context workload (documents, code bases, agents' histories): prompts log-normal with mean
# 12,000 and 99th percentile 85,000 tokens, outputs log-normal with mean 350, capped at a 128K context.
# sigma solves exp(mu + 2.326 sigma) = 85000 with exp(mu + sigma^2 / 2) = 12000 (the smaller root).
LONG_CONTEXT_PROMPT_MEAN, LONG_CONTEXT_PROMPT_P99 = 12_000, 85_000
LONG_CONTEXT_OUTPUT_MEAN, LONG_CONTEXT_OUTPUT_SIGMA = 350, 0.9
LONG_CONTEXT_MAX_TOKENS = 131_072
_Z99 = 2.3263478740408408


def _long_context_sigma() -> float:
    gap = math.log(LONG_CONTEXT_PROMPT_P99 / LONG_CONTEXT_PROMPT_MEAN)
    return _Z99 - math.sqrt(_Z99 * _Z99 - 2 * gap)


def long_context_workload(rate_per_s: float, duration_s: float, seed: int = 0) -> list[TraceRequest]:
    """Poisson arrivals of long-context requests (see LONG_CONTEXT_*): on the paper's setups about a
    quarter of the prompts alone exceed one GPU's KV capacity, so those requests span GPUs."""
    if rate_per_s <= 0 or duration_s <= 0:
        raise ValueError("rate and duration must be positive")
    rng = random.Random(seed)
    sigma = _long_context_sigma()
    out: list[TraceRequest] = []
    for t in _arrivals(rng, rate_per_s, duration_s):
        prompt, output = _within_context(_lognormal(rng, LONG_CONTEXT_PROMPT_MEAN, sigma),
                                         _lognormal(rng, LONG_CONTEXT_OUTPUT_MEAN, LONG_CONTEXT_OUTPUT_SIGMA),
                                         LONG_CONTEXT_MAX_TOKENS)
        out.append(TraceRequest(f"r{len(out)}", t, prompt, output))
    return out


def slice_trace(requests: Iterable[TraceRequest], start_s: float, duration_s: float) -> list[TraceRequest]:
    """A window of a trace, re-based to start at 0 (tests cut small slices at run time)."""
    picked = [r for r in requests if start_s <= r.arrival_s < start_s + duration_s]
    return [replace(r, arrival_s=r.arrival_s - start_s) for r in picked]
