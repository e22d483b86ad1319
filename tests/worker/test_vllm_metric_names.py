"""vLLM's metric names on every worker: emulated on the builtin engine's, vLLM's own on a vLLM worker's.

Dashboards and KEDA / HPA rules written for vLLM read `vllm:*` series; a worker serves them whatever
its engine (kvfleet.worker.metrics). Both cases are checked over a real agent's HTTP /metrics after
a request of known size, read with prometheus_client's own parser.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import time
from collections.abc import Iterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from worker_testing import TEST_KV_CAPACITY_BYTES, EngineLoop, StartedEngine, skip_without_vllm, start_engine

from kvfleet.worker.agent import Agent, AgentConfig
from kvfleet.worker.engines import EngineConfig, load_engine
from kvfleet.worker.engines.base import Engine, SamplingParams
from kvfleet.worker.gpu import GPUProbe
from kvfleet.worker.metrics import VLLM_TIME_TO_FIRST_TOKEN_BUCKETS_S, WorkerMetrics
from kvfleet.worker.streams import Job
from kvfleet.worker.text import Tokenizer

# router_testing.py (a real agent or router served on loopback); with --import-mode=importlib its
# folder is not on sys.path.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "router"))
from router_testing import Server, serve  # noqa: E402

MODEL = "tiny"
PROMPT_TOKENS = [5, 17, 42, 99, 123, 7, 64]
OUTPUT_TOKENS = 9


def served(engine: Engine, tiny_model_dir: Path, loop: EngineLoop) -> Iterator[Server]:
    """A real agent over `engine` on loopback (router_testing's server), ready, its agent at `.agent`."""
    agent = Agent(AgentConfig(model_name=MODEL, migration_port=None), engine, Tokenizer(tiny_model_dir), None)
    server = serve(loop, agent.app())
    server.agent = agent
    yield server
    loop.run(server.runner.cleanup())


def complete(server: Server) -> dict[str, Any]:
    """One completion of PROMPT_TOKENS (token ids, so the prompt's size is exact) and OUTPUT_TOKENS tokens."""
    status, body = server.post("/v1/completions", {"model": MODEL, "prompt": PROMPT_TOKENS, "max_tokens": OUTPUT_TOKENS,
                                                   "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    assert body["usage"] == {"prompt_tokens": len(PROMPT_TOKENS), "completion_tokens": OUTPUT_TOKENS,
                             "total_tokens": len(PROMPT_TOKENS) + OUTPUT_TOKENS}
    return dict(body)


def metric_families(server: Server) -> list[Metric]:
    status, _, raw = server.request("GET", "/metrics")
    assert status == 200
    return list(text_string_to_metric_families(raw.decode()))


def samples(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, by (name, sorted labels)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in metric_families(server) for s in family.samples}


def family_types(server: Server) -> dict[str, str]:
    """Every family of /metrics: its type by name."""
    return {f.name: f.type for f in metric_families(server)}


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


# ----------------------------------------------------------------------------------------- builtin


@pytest.fixture(scope="module")
def builtin_worker(tiny_model_dir: Path, engine_loop: EngineLoop) -> Iterator[Server]:
    # Its own engine: the counters start at 0, so they must equal this module's requests exactly.
    engine = load_engine("builtin", EngineConfig(model_path=tiny_model_dir, kv_capacity_bytes=TEST_KV_CAPACITY_BYTES,
                                                 max_model_len=256))
    yield from served(engine, tiny_model_dir, engine_loop)


def test_a_builtin_worker_serves_vllms_names_with_vllms_labels_and_buckets(builtin_worker: Server) -> None:
    idle = samples(builtin_worker)
    labels = {"model_name": MODEL, "engine": "0"}
    assert value(idle, "vllm:num_requests_running", **labels) == 0
    assert value(idle, "vllm:num_requests_waiting", **labels) == 0
    assert value(idle, "vllm:kv_cache_usage_perc", **labels) == 0
    assert value(idle, "vllm:prompt_tokens_total", **labels) == 0
    assert value(idle, "vllm:time_to_first_token_seconds_count", **labels) == 0
    assert value(idle, "vllm:request_success_total", **labels, finished_reason="length") == 0

    complete(builtin_worker)
    after = samples(builtin_worker)
    # A counter's samples end in _total (prometheus_client adds it, as it does to vLLM's own).
    assert value(after, "vllm:prompt_tokens_total", **labels) == len(PROMPT_TOKENS)
    assert value(after, "vllm:generation_tokens_total", **labels) == OUTPUT_TOKENS
    assert value(after, "vllm:request_success_total", **labels, finished_reason="length") == 1
    assert value(after, "vllm:request_success_total", **labels, finished_reason="stop") == 0
    # One first token, timed from arrival: a positive time, in vLLM's bucket boundaries.
    assert value(after, "vllm:time_to_first_token_seconds_count", **labels) == 1
    ttft_s = value(after, "vllm:time_to_first_token_seconds_sum", **labels)
    assert ttft_s is not None and ttft_s > 0
    buckets = {float(dict(key)["le"]) for (name, key) in after if name == "vllm:time_to_first_token_seconds_bucket"}
    assert buckets == {*VLLM_TIME_TO_FIRST_TOKEN_BUCKETS_S, float("inf")}
    # The builtin engine gives one token a step: every token after the first is one inter-token latency.
    assert value(after, "vllm:inter_token_latency_seconds_count", **labels) == OUTPUT_TOKENS - 1
    itl_s = value(after, "vllm:inter_token_latency_seconds_sum", **labels)
    tpot_s = value(after, "vllm:request_time_per_output_token_seconds_sum", **labels)
    assert value(after, "vllm:request_time_per_output_token_seconds_count", **labels) == 1
    # The request's time per output token is its decode time over its tokens after the first.
    assert itl_s is not None and tpot_s == pytest.approx(itl_s / (OUTPUT_TOKENS - 1))
    e2e_s = value(after, "vllm:e2e_request_latency_seconds_sum", **labels)
    assert e2e_s is not None and e2e_s >= ttft_s + itl_s
    # The request has ended: nothing runs, waits or holds KV.
    assert value(after, "vllm:num_requests_running", **labels) == 0
    assert value(after, "vllm:num_requests_waiting", **labels) == 0
    assert value(after, "vllm:kv_cache_usage_perc", **labels) == 0


def test_the_kv_usage_fraction_is_the_workers_used_over_capacity_while_a_request_holds_kv(
    builtin_worker: Server, engine_loop: EngineLoop,
) -> None:
    """vLLM's kv_cache_usage_perc is a 0-1 fraction: used / capacity, what kvfleet's own two gauges say."""
    agent = builtin_worker.agent
    labels = {"model_name": MODEL, "engine": "0"}

    def sample(name: str, **named: str) -> float:
        found = agent.metrics.registry.get_sample_value(name, named)
        assert found is not None, name
        return found

    async def figures_after_the_first_token() -> tuple[float, float, float, float]:
        job = Job("kv-usage", list(PROMPT_TOKENS), SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0,
                                                                  ignore_eos=True), ())
        seen: tuple[float, float, float, float] | None = None
        async with aclosing(agent.streams.deltas(job)) as deltas:
            async for _ in deltas:  # read to the end, so the request finishes rather than aborts
                if seen is None:
                    seen = (sample("vllm:num_requests_running", **labels), sample("vllm:kv_cache_usage_perc", **labels),
                            sample("kvfleet_worker_kv_used_bytes"), sample("kvfleet_worker_kv_capacity_bytes"))
        assert seen is not None
        return seen

    running, ratio, used_bytes, capacity_bytes = engine_loop.run(figures_after_the_first_token())
    assert running == 1 and capacity_bytes > 0 and used_bytes > 0
    assert ratio == used_bytes / capacity_bytes and 0 < ratio < 1
    assert sample("vllm:kv_cache_usage_perc", **labels) == 0  # its blocks are free again


# -------------------------------------------------------------------------------------------- vLLM


class Lent:
    """The session's vLLM engine lent to one agent: the agent's shutdown leaves it running for the
    other tests (starting one costs about 25 s)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def stop(self) -> None:
        pass


@pytest.fixture(scope="module")
def vllm_worker(tiny_model_dir: Path, engine_loop: EngineLoop, started_engines: dict[str, StartedEngine]) -> Iterator[Server]:
    started = start_engine("vllm", tiny_model_dir, started_engines, engine_loop)
    yield from served(Lent(started.engine), tiny_model_dir, engine_loop)  # type: ignore[arg-type]


def test_a_vllm_worker_serves_vllms_own_families_once(vllm_worker: Server) -> None:
    before = samples(vllm_worker)
    complete(vllm_worker)
    # vLLM records a step's stats right after handing its outputs over: wait for the scrape to show it.
    deadline = time.monotonic() + 30
    while True:
        after = samples(vllm_worker)
        generated = [v for (name, _), v in after.items() if name == "vllm:generation_tokens_total"]
        generated_before = [v for (name, _), v in before.items() if name == "vllm:generation_tokens_total"]
        if generated and sum(generated) - sum(generated_before) >= OUTPUT_TOKENS or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    families = family_types(vllm_worker)
    # vLLM's own families, including ones the emulation does not have: they come from vLLM's logger.
    for name, kind in {"vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
                       "vllm:kv_cache_usage_perc": "gauge", "vllm:prompt_tokens": "counter",
                       "vllm:generation_tokens": "counter", "vllm:time_to_first_token_seconds": "histogram",
                       "vllm:inter_token_latency_seconds": "histogram",
                       "vllm:request_time_per_output_token_seconds": "histogram",
                       "vllm:num_preemptions": "counter", "vllm:iteration_tokens_total": "histogram"}.items():
        assert families.get(name) == kind, (name, families.get(name))

    def total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
        found = [(dict(labels), v) for (n, labels), v in samples.items() if n == name]
        assert len(found) == 1, f"{name}: {found}"  # one engine, one series: nothing exported twice
        assert set(found[0][0]) == {"model_name", "engine"} and found[0][0]["engine"] == "0"
        return found[0][1]

    # This engine's figures, live: they moved by exactly this request.
    assert total(after, "vllm:generation_tokens_total") - total(before, "vllm:generation_tokens_total") == OUTPUT_TOKENS
    assert total(after, "vllm:prompt_tokens_total") - total(before, "vllm:prompt_tokens_total") == len(PROMPT_TOKENS)
    assert (total(after, "vllm:time_to_first_token_seconds_count")
            - total(before, "vllm:time_to_first_token_seconds_count")) == 1
    assert total(after, "vllm:num_requests_running") == 0
    assert vllm_worker.agent.metrics.vllm_names is None  # the emulation is off where vLLM's own are served


def test_the_emulated_names_and_types_are_vllms_own_definitions() -> None:
    """Each name the builtin worker emulates is defined, with that type, by the installed vLLM's
    Prometheus stat logger (read from its source, so the check needs no engine)."""
    skip_without_vllm()
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    source = (Path(spec.submodule_search_locations[0]) / "v1" / "metrics" / "loggers.py").read_text()
    defined = {name: kind for kind, name in
               re.findall(r"self\._(gauge|counter|histogram)_cls\(\s*name=\"(vllm:[\w:]+)\"", source)}
    metrics = WorkerMetrics(lambda: 0.0, lambda: 1.0, lambda: 0.0, lambda: 0.0, GPUProbe(), model_name=MODEL)
    emulated = {f.name: f.type for f in metrics.registry.collect() if f.name.startswith("vllm:")}
    assert len(emulated) == 10
    assert {name: defined.get(name) for name in emulated} == emulated
