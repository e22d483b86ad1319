"""The custom resources `LLMPool` and `KVMigration` as pydantic models: the one source of crds/*.yaml.

Everything the API server checks is declared here once: field types, bounds and defaults become the
OpenAPI schema, and the cross-field rules become CEL (`x-kubernetes-validations`), so a bad manifest is
refused by `kubectl apply` with a message naming the field instead of crashing the operator later.
The operator parses the same objects with these models, and the model validators mirror the CEL
rules, so both sides agree on what a valid spec is.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, model_validator
from pydantic.alias_generators import to_camel

from kvfleet.api.quantity import parse_quantity, quantity_bytes
from kvfleet.mell.migration import MoveMode
from kvfleet.mell.models import kv_capacity_bytes, tpot_load_cap
from kvfleet.mell.size_classes import RoutedSizeClassName

GROUP = "kvfleet.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
# Every object of a pool (worker pods, KVMigrations, KV-load reports) carries its name in this label.
POOL_LABEL = f"{GROUP}/pool"
# A disaggregated pool's worker pods say which half of a request they serve (docs/operator.md,
# "Disaggregated pools"): "prefill" pods prefill and hand the KV over, "decode" pods (MELL's GPUs)
# decode. The router and the workers read it; a colocated pool's pods carry no such label.
ROLE_LABEL = f"{GROUP}/role"
Role = Literal["prefill", "decode"]
# Scale from zero (docs/router.md): the router writes on its LLMPool how many requests it holds for
# want of a Ready worker and when ("<count> <unix seconds>"), re-written every HELD_REFRESH_S while
# any are held; the operator keeps a worker while it reads a count written within HELD_FRESH_S, so a
# router that died leaves no demand behind.
HELD_REQUESTS_ANNOTATION = "kvfleet.dev/held-requests"
HELD_REFRESH_S = 20.0
HELD_FRESH_S = 3 * HELD_REFRESH_S

# A pool's name prefixes its worker pods, router Deployment and Service ("<pool>-worker-<n>") and is
# a label value, so it must be a DNS-1035 label with room left for the suffixes.
MAX_POOL_NAME_LENGTH = 40
DNS_1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS_1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


def _check_quantity(value: str) -> str:
    if parse_quantity(value) <= 0:
        raise ValueError(f"{value!r} must be a positive quantity")
    return value


# Quantities are strings checked by CEL's isQuantity() on the server and parse_quantity() here.
Quantity = Annotated[
    str,
    StringConstraints(max_length=32),
    AfterValidator(_check_quantity),
    Field(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "isQuantity(self) && quantity(self).isGreaterThan(quantity('0'))",
                    "message": "must be a positive Kubernetes quantity such as 40Gi or 500M",
                }
            ]
        }
    ),
]
PodName = Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=DNS_1123_SUBDOMAIN)]
# A KVMigration's status.message: its writers cut what they say to this.
SHORT_TEXT_MAX_LENGTH = 256
ShortText = Annotated[str, StringConstraints(max_length=SHORT_TEXT_MAX_LENGTH)]


class _Model(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are errors, values are immutable."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)

    def to_wire(self) -> dict[str, Any]:
        """The object as the API server stores it: camelCase, JSON types, and only the fields that were
        set (given, or read), so a status merge patch says no more than its writer meant to."""
        return self.model_dump(by_alias=True, mode="json", exclude_unset=True)


# ----------------------------------------------------------------------------------------- LLMPool


class PersistentVolumeClaimSource(_Model):
    """An existing PersistentVolumeClaim that holds the weights."""

    claim_name: Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=DNS_1123_SUBDOMAIN)]
    read_only: bool = True


class HostPathSource(_Model):
    """A directory on the GPU node that holds the weights (pre-seeded nodes, local tests)."""

    path: Annotated[str, StringConstraints(min_length=1, max_length=4096, pattern=r"^/")]


class ModelVolume(_Model):
    """The volume mounted read-only at `model.path` in every worker. Exactly one source."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.persistentVolumeClaim) != has(self.hostPath)",
                    "message": "set exactly one of persistentVolumeClaim or hostPath",
                }
            ]
        }
    )
    persistent_volume_claim: PersistentVolumeClaimSource | None = None
    host_path: HostPathSource | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ModelVolume:
        if (self.persistent_volume_claim is None) == (self.host_path is None):
            raise ValueError("set exactly one of persistentVolumeClaim or hostPath")
        return self


class ModelSpec(_Model):
    """The model to serve: HF-format weights (config.json, *.safetensors, tokenizer) at a path.

    Weights are never downloaded at run time; mount them with `volume` or bake them into the image.
    """

    name: Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:-]*$")] = (
        Field(description="The model name clients send in the OpenAI `model` field.")
    )
    path: Annotated[str, StringConstraints(min_length=1, max_length=4096, pattern=r"^/")] = Field(
        description="Absolute directory inside the worker container holding the HF-format model."
    )
    volume: ModelVolume | None = Field(default=None, description="Volume mounted read-only at `path`.")


class CapacitySpec(_Model):
    """How much KV cache one worker holds (MELL's C).

    Either given (`kvCapacityPerWorker`) or derived: GPU memory x GPUs per worker x (1 - activation
    reserve fraction) - model weights. Workers report the capacity their engine really allocated;
    this value is what MELL plans with before the first report.
    """

    gpu_memory: Quantity = Field(default="80Gi", description="Memory of one GPU.")
    model_weights: Quantity | None = Field(
        default=None, description="Bytes of weights each worker loads (needed when capacity is derived)."
    )
    activation_reserve_fraction: float = Field(
        default=0.1, ge=0, lt=1, description="Fraction of GPU memory kept for activations and the runtime."
    )
    kv_capacity_per_worker: Quantity | None = Field(
        default=None, description="KV-cache bytes per worker; when set, nothing is derived."
    )


class ElasticMemorySpec(_Model):
    """Elastic memory in the workers (eLLM, docs/elastic-memory.md; both engines).

    Each worker keeps its KV cache and its activations in one pool, the KV capacity plus the
    activation reserve it would otherwise keep (capacity.activationReserveFraction of the GPUs), and the
    KV of requests that wait (builtin) or that vLLM preempted (vllm) in a CPU buffer, whose share the
    latency objectives scale (eLLM Algorithm 2). Workers then report a capacity that moves with their
    activations, and MELL plans with what they report.
    """

    enabled: bool = Field(default=False, description="Share one memory pool between KV cache and activations.")
    cpu_buffer: Quantity | None = Field(
        default=None,
        description="Host memory per worker for the KV of waiting (builtin) or preempted (vllm) requests; none by default.",
    )
    ttft_milliseconds: float | None = Field(
        default=None, gt=0, le=3.6e6,
        description="TTFT objective the worker's CPU buffer is scaled by (eLLM Algorithm 2); also "
        "the objective a disaggregated pool's prefill workers are sized by.",
    )
    tpot_milliseconds: float | None = Field(
        default=None, gt=0, le=60000,
        description="TPOT objective the worker's CPU buffer is scaled by (eLLM Algorithm 2).",
    )


class PrefixCachingSpec(_Model):
    """Context caching (MemServe, docs/caching.md): workers keep finished requests' KV by prompt prefix
    and prefill new requests only past the prefix they hold; the router sends a request where its
    prefix is cached when that is sooner to its first token and MELL finds room there."""

    enabled: bool = Field(default=False, description="Keep finished requests' KV in the workers, by prompt prefix.")
    routing: Literal["prompt-tree", "session", "none"] = Field(
        default="prompt-tree",
        description="How the router weighs cached prefixes: the global prompt tree (MemServe §6), the worker a "
        "session (the request's `user`) was last placed on, or not at all.",
    )
    ttl_seconds: float = Field(
        default=600, gt=0, le=86400,
        description="How long the router believes a worker still holds a prefix it last saw there.",
    )


class DistKVSpec(_Model):
    """DistKV (Infinite-LLM §4.3-4.5, docs/operator.md "DistKV"): a request longer than one worker's KV
    capacity borrows KV blocks from other workers of the pool and is attended with DistAttention.

    Each worker lends at most `lendCapFraction` of its KV capacity (§4.3's cap, so a creditor keeps
    room for its own requests); the operator plays the gManager: it keeps the debt ledger, publishes
    each worker's creditor candidates in the pool's status, and finds debt cycles (DGFM), which the
    workers on them resolve by recall-and-swap when `dgfm` is true.
    """

    enabled: bool = Field(default=False, description="Let workers borrow KV blocks from each other (DistAttention).")
    lend_cap_fraction: float = Field(
        default=0.5, ge=0, le=1,
        description="Most of its KV capacity a worker lends to other workers' requests (0 lends none).",
    )
    dgfm: bool = Field(
        default=False,
        description="Carry out DGFM's recall-and-swap: debtors on a debt cycle bring their KV home from their "
        "creditors (false: cycles are only reported). Off by default: measured, it buys nothing here "
        "(docs/distkv.md).",
    )


class PrefillWorkersSpec(_Model):
    """Bounds on a disaggregated pool's prefill worker pods (one GPU worker each, never one of MELL's)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": "self.min <= self.max", "message": "min must be less than or equal to max", "fieldPath": ".min"}
            ]
        }
    )
    min: int = Field(default=1, ge=0, le=10000, description="Prefill workers kept even when idle.")
    max: int = Field(
        default=4, ge=1, le=10000,
        description="Prefill workers never exceeded; above it, the router prefills on decode workers (choice: per-request).",
    )

    @model_validator(mode="after")
    def _ordered(self) -> PrefillWorkersSpec:
        if self.min > self.max:
            raise ValueError("disaggregation.prefillWorkers.min must be less than or equal to disaggregation.prefillWorkers.max")
        return self


# The caching milestones each engine's workers serve in a disaggregated pool (the pydantic check and the
# CEL rule both read this, so the CRDs regenerate with it: `make crds`). vLLM hands requests over and
# takes them in through kvfleet's KV connector (PD-Basic), but its prefix cache is vLLM's own, which
# cannot take in KV another worker sends (PD-Caching-2 and -3) and is not tested behind a hand-over.
DISAGGREGATION_CACHING: dict[str, tuple[str, ...]] = {"builtin": ("none", "prefill", "decode", "full"),
                                                      "vllm": ("none",)}


class DisaggregationSpec(_Model):
    """Disaggregated prefill and decode (MemServe §5, arXiv 2406.17565; docs/operator.md "Disaggregated pools").

    Prefill worker pods prefill a request and hand its KV to a decode worker pod, which decodes it. The
    decode workers are the pool's workers as MELL packs, scales and drains them; the prefill workers are
    extra pods scaled by the prompt tokens queued on them. Off by default: every worker does both.
    """

    enabled: bool = Field(default=False, description="Run separate prefill and decode worker pods.")
    prefill_workers: PrefillWorkersSpec = Field(default_factory=PrefillWorkersSpec)
    caching: Literal["none", "prefill", "decode", "full"] = Field(
        default="full",
        description="Where finished prompts' KV is kept (MemServe's milestones; needs prefixCaching.enabled unless "
        "none). none: PD-Basic, nothing cached, every prompt prefilled whole at a prefill worker. prefill: "
        "PD-Caching-1, prefill workers keep prompts' KV and prefill only past the prefix they hold. decode: "
        "PD-Caching-2, prefill and decode workers both keep it (the decode worker caches the KV it was handed). "
        "full: PD-Caching-3, also the KV decoding produced is sent back to the prefill worker, so a "
        "conversation's next turn finds its whole history cached at P.",
    )
    layout: Literal["by-request-aggregated", "by-request", "by-layer"] = Field(
        default="by-request-aggregated",
        description="How a request's KV crosses from prefill to decode worker (MemServe §5.2): by-request-aggregated "
        "sends it in one transfer per request; by-request sends one per layer x K/V x block; by-layer streams "
        "each layer's KV while the prefill computes the next (builtin engine; vLLM workers send it whole).",
    )
    choice: Literal["per-request", "always"] = Field(
        default="per-request",
        description="always: every request is prefilled at a prefill worker (MemServe's setting). per-request: the "
        "router prefills a request on its decode worker when its cost model says that is sooner.",
    )

    def caches_at(self, role: Role) -> bool:
        """Whether a worker of this role runs the prefix cache under this pool's `caching`."""
        if role == "prefill":
            return self.caching in ("prefill", "decode", "full")
        return self.caching in ("decode", "full")


class SchedulingSpec(_Model):
    """Which placement policy runs every epoch (MELL or a baseline) and how MELL ranks GPUs."""

    policy: Literal["mell", "mell-paper", "best-fit", "worst-fit", "load-balance"] = Field(
        default="mell", description="mell: kvfleet's default (MELL with consolidation, docs/mell.md); mell-paper: "
        "MELL's Fig. 10 exactly as the paper states it; or a baseline.")
    epoch_seconds: float = Field(default=5.0, gt=0, le=3600, description="Seconds between scheduling epochs.")
    workload_weight: float = Field(default=1.0, ge=0, description="Weight of GPU load in MELL's GPU priority.")
    distance_weight: float = Field(
        default=1.0, ge=0, description="Weight of distance (node, zone) in MELL's GPU priority."
    )


class WorkersSpec(_Model):
    """Bounds on the number of worker pods (one GPU worker each)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": "self.min <= self.max", "message": "min must be less than or equal to max", "fieldPath": ".min"}
            ]
        }
    )
    min: int = Field(default=1, ge=0, le=10000, description="Workers kept even when idle.")
    max: int = Field(default=8, ge=1, le=10000, description="Workers never exceeded; above it, requests wait.")

    @model_validator(mode="after")
    def _ordered(self) -> WorkersSpec:
        if self.min > self.max:
            raise ValueError("workers.min must be less than or equal to workers.max")
        return self


# A pool's migration *policy*: "adaptive" lets MELL's §V planner choose a MoveMode per request (KV
# copy, token re-prefill or hybrid) within the pool's boundaries; "kv" and "token" force that MoveMode
# for every move. Not a MoveMode itself, so not the KVMigration's `mode` type (test_api checks that
# the forced values are MoveModes).
MovePolicy = Literal["adaptive", "kv", "token"]


class MigrationSpec(_Model):
    """How requests move between workers (MELL section V, adaptive hybrid migration)."""

    mode: MovePolicy = Field(
        default="adaptive", description="adaptive chooses KV copy or token re-prefill per request."
    )
    communication_boundary_bytes_per_second: Quantity = Field(
        default="10G", description="Bytes per second one link may carry for KV transfers."
    )
    computation_boundary_tokens_per_second: int = Field(
        default=20000, gt=0, le=10**9, description="Tokens per second one worker may re-prefill for migrations."
    )
    timeout_seconds: int = Field(default=120, gt=0, le=86400, description="A migration not finished by then fails.")
    ttl_seconds_after_finished: int = Field(
        default=600, ge=0, le=7 * 86400, description="Finished KVMigration objects are deleted after this."
    )


class SloSpec(_Model):
    """Service-level objectives the scheduler keeps (docs/mell.md, "TPOT objective").

    A decode step reads the weights and the batch's KV once: step = (modelWeights + KV) / (bandwidth
    x efficiency) + requests x per-sequence overhead. With `tpotMilliseconds` the default policy never
    packs a worker past the KV load at which that step would exceed it (kvfleet.mell.tpot_load_cap).
    """

    tpot_milliseconds: float | None = Field(
        default=None, gt=0, le=60000,
        description="Time per output token no worker may exceed; needs gpuMemoryBandwidth and capacity.modelWeights.",
    )
    gpu_memory_bandwidth: Quantity | None = Field(
        default=None, description="Memory bandwidth of one worker in bytes per second (e.g. 1555G for an A100-40GB)."
    )
    bandwidth_efficiency: float = Field(default=0.8, gt=0, le=1, description="Share of the bandwidth a decode step reaches.")
    per_sequence_overhead_microseconds: float = Field(
        default=200.0, ge=0, le=1e6, description="Decode step time each request in the batch adds."
    )


class AutoscalingSpec(_Model):
    """The handshake with the cluster autoscaler or Karpenter."""

    scale_down_delay_seconds: int = Field(
        default=60, ge=0, le=86400, description="An empty worker is kept this long before it is deleted."
    )
    headroom_workers: int = Field(
        default=0, ge=0, le=1000, description="Low-priority headroom pods that keep spare GPU nodes warm."
    )


class Toleration(_Model):
    """A toleration copied onto every worker pod (same fields as core/v1 Toleration)."""

    key: Annotated[str, StringConstraints(max_length=316)] | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: Annotated[str, StringConstraints(max_length=63)] | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class EnvVar(_Model):
    """An extra environment variable for the worker container."""

    name: Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")]
    value: Annotated[str, StringConstraints(max_length=32768)] = ""


class ResourceSpec(_Model):
    """Container resources beyond the GPUs, which the operator sets from `gpusPerWorker`."""

    requests: dict[str, Quantity] = Field(default_factory=dict, max_length=16)
    limits: dict[str, Quantity] = Field(default_factory=dict, max_length=16)


class WorkerTemplateSpec(_Model):
    """Overrides applied to every worker pod the operator creates."""

    image: Annotated[str, StringConstraints(min_length=1, max_length=512)] = "kvfleet/worker:0.1.0"
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    resources: ResourceSpec | None = None
    node_selector: dict[str, Annotated[str, StringConstraints(max_length=63)]] = Field(
        default_factory=dict, max_length=64
    )
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64)
    priority_class_name: Annotated[str, StringConstraints(max_length=253, pattern=DNS_1123_SUBDOMAIN)] | None = None
    env: list[EnvVar] = Field(default_factory=list, max_length=128)


# The cross-field rules of spec.disaggregation, said once for the CEL rules and the model validator.
_DISAGGREGATED_OFF = "!has(self.disaggregation) || !has(self.disaggregation.enabled) || !self.disaggregation.enabled"
_MESSAGE_CACHING_NEEDS_PREFIX_CACHE = ("disaggregation.caching other than none needs prefixCaching.enabled: true "
                                       "(the workers' prefix cache is what caches at P and D)")
_MESSAGE_NO_DISTKV = ("disaggregation.enabled cannot be combined with distkv.enabled: a request whose KV spans "
                      "workers cannot be handed over")
_MESSAGE_DISTKV_ENGINE = ("distkv.enabled on a vllm pool needs prefixCaching.enabled: false (a vLLM worker moves a "
                          "spanning request's own blocks to lenders, never shared prefix blocks)")
_MESSAGE_ENGINE = ("disaggregation.caching: a vllm pool serves only caching: none (vLLM's prefix cache cannot take "
                   "in KV another worker sends); the builtin engine serves every milestone")

class LLMPoolSpec(_Model):
    """What model to serve, with which engine, on how many GPUs, scheduled how."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.replicas) || self.replicas <= self.workers.max",
                    "message": "replicas must not exceed workers.max",
                    "fieldPath": ".replicas",
                },
                {
                    "rule": "!has(self.slo) || !has(self.slo.tpotMilliseconds) || (has(self.slo.gpuMemoryBandwidth) "
                    "&& has(self.capacity.modelWeights) && (!has(self.scheduling) || !has(self.scheduling.policy) || "
                    "self.scheduling.policy == 'mell'))",
                    "message": "slo.tpotMilliseconds needs slo.gpuMemoryBandwidth, capacity.modelWeights and "
                    "scheduling.policy mell",
                    "fieldPath": ".slo",
                },
                {
                    "rule": f"{_DISAGGREGATED_OFF} || (has(self.disaggregation.caching) && "
                    "self.disaggregation.caching == 'none') || (has(self.prefixCaching) && "
                    "has(self.prefixCaching.enabled) && self.prefixCaching.enabled)",
                    "message": _MESSAGE_CACHING_NEEDS_PREFIX_CACHE,
                    "fieldPath": ".disaggregation.caching",
                },
                {
                    "rule": f"{_DISAGGREGATED_OFF} || !has(self.distkv) || !has(self.distkv.enabled) || "
                    "!self.distkv.enabled",
                    "message": _MESSAGE_NO_DISTKV,
                    "fieldPath": ".disaggregation.enabled",
                },
                {
                    # The engine defaults to vllm and caching to full: an absent engine or caching is read so.
                    "rule": f"{_DISAGGREGATED_OFF} || (has(self.engine) && self.engine == 'builtin') || "
                    "(has(self.disaggregation.caching) && self.disaggregation.caching in "
                    f"[{', '.join(repr(c) for c in DISAGGREGATION_CACHING['vllm'])}])",
                    "message": _MESSAGE_ENGINE,
                    "fieldPath": ".disaggregation.caching",
                },
                {
                    # The engine defaults to vllm and prefix caching to off: absent fields are read so.
                    "rule": "!has(self.distkv) || !has(self.distkv.enabled) || !self.distkv.enabled || "
                    "(has(self.engine) && self.engine == 'builtin') || !has(self.prefixCaching) || "
                    "!has(self.prefixCaching.enabled) || !self.prefixCaching.enabled",
                    "message": _MESSAGE_DISTKV_ENGINE,
                    "fieldPath": ".distkv.enabled",
                },
                {
                    "rule": "has(self.capacity.kvCapacityPerWorker) || has(self.capacity.modelWeights)",
                    "message": "set capacity.kvCapacityPerWorker, or capacity.modelWeights so it can be derived",
                    "fieldPath": ".capacity",
                },
                {
                    "rule": "!has(self.capacity.kvCapacityPerWorker) || "
                    "quantity(self.capacity.kvCapacityPerWorker).asApproximateFloat() <= "
                    "quantity(self.capacity.gpuMemory).asApproximateFloat() * double(self.gpusPerWorker)",
                    "message": "capacity.kvCapacityPerWorker exceeds capacity.gpuMemory x gpusPerWorker",
                    "fieldPath": ".capacity.kvCapacityPerWorker",
                },
                {
                    "rule": "has(self.capacity.kvCapacityPerWorker) || !has(self.capacity.modelWeights) || "
                    "quantity(self.capacity.gpuMemory).asApproximateFloat() * double(self.gpusPerWorker) * "
                    "(1.0 - self.capacity.activationReserveFraction) > "
                    "quantity(self.capacity.modelWeights).asApproximateFloat()",
                    "message": "capacity.modelWeights leave no room for KV cache on gpusPerWorker x gpuMemory "
                    "after the activation reserve",
                    "fieldPath": ".capacity.modelWeights",
                },
            ]
        }
    )

    model: ModelSpec
    engine: Literal["vllm", "builtin"] = Field(default="vllm", description="The engine the workers run.")
    attention: Literal["default", "distattention"] = Field(
        default="default",
        description="How workers attend: the engine's own attention (builtin: torch SDPA; vllm: its backend for the "
                    "platform), or kvfleet's DistAttention kernels (partials merged by ScaleReduce, which KV held "
                    "elsewhere needs; distkv.enabled implies it).",
    )
    gpus_per_worker: int = Field(default=1, ge=1, le=16, description="nvidia.com/gpu requested by each worker pod.")
    capacity: CapacitySpec = Field(default_factory=CapacitySpec)
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    workers: WorkersSpec = Field(default_factory=WorkersSpec)
    replicas: int | None = Field(
        default=None,
        ge=0,
        le=10000,
        description="Floor on active workers set through the scale subresource (kubectl scale); MELL may use more.",
    )
    migration: MigrationSpec = Field(default_factory=MigrationSpec)
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    slo: SloSpec = Field(default_factory=SloSpec)
    elastic_memory: ElasticMemorySpec = Field(default_factory=ElasticMemorySpec)
    prefix_caching: PrefixCachingSpec = Field(default_factory=PrefixCachingSpec)
    distkv: DistKVSpec = Field(default_factory=DistKVSpec)
    disaggregation: DisaggregationSpec = Field(default_factory=DisaggregationSpec)
    worker_template: WorkerTemplateSpec = Field(default_factory=WorkerTemplateSpec)

    @model_validator(mode="after")
    def _consistent(self) -> LLMPoolSpec:
        if self.replicas is not None and self.replicas > self.workers.max:
            raise ValueError("replicas must not exceed workers.max")
        self.kv_capacity_per_worker_bytes()  # raises when it cannot be derived
        self.tpot_load_cap()  # raises when the objective cannot be turned into a load cap
        self._check_disaggregation()
        if self.distkv.enabled and self.engine != "builtin" and self.prefix_caching.enabled:
            raise ValueError(_MESSAGE_DISTKV_ENGINE)
        return self

    def _check_disaggregation(self) -> None:
        """The CEL rules on spec.disaggregation, for a spec the API server did not see (tests, the operator)."""
        if not self.disaggregation.enabled:
            return
        if self.disaggregation.caching not in DISAGGREGATION_CACHING[self.engine]:
            raise ValueError(_MESSAGE_ENGINE)
        if self.distkv.enabled:
            raise ValueError(_MESSAGE_NO_DISTKV)
        if self.disaggregation.caching != "none" and not self.prefix_caching.enabled:
            raise ValueError(_MESSAGE_CACHING_NEEDS_PREFIX_CACHE)

    def prefix_cache_on(self, role: Role | None) -> bool:
        """Whether a worker of this role runs the prefix cache: prefixCaching.enabled, and in a
        disaggregated pool only where disaggregation.caching caches (DisaggregationSpec.caches_at)."""
        if not self.prefix_caching.enabled:
            return False
        return role is None or self.disaggregation.caches_at(role)

    def tpot_load_cap(self) -> tuple[int, int] | None:
        """(max_load_bytes, load_bytes_per_request) of the TPOT objective (see SloSpec), or None."""
        slo = self.slo
        if slo.tpot_milliseconds is None:
            return None
        if self.scheduling.policy != "mell":
            raise ValueError("slo.tpotMilliseconds is kept by the default policy (scheduling.policy: mell) only")
        if slo.gpu_memory_bandwidth is None or self.capacity.model_weights is None:
            raise ValueError("slo.tpotMilliseconds needs slo.gpuMemoryBandwidth and capacity.modelWeights")
        bandwidth = quantity_bytes(slo.gpu_memory_bandwidth) * self.gpus_per_worker * slo.bandwidth_efficiency
        return tpot_load_cap(slo.tpot_milliseconds / 1000.0, quantity_bytes(self.capacity.model_weights), bandwidth,
                             slo.per_sequence_overhead_microseconds / 1e6)

    def distattention(self) -> bool:
        """Whether workers attend through DistAttention: asked, or needed by DistKV."""
        return self.attention == "distattention" or self.distkv.enabled

    def lend_cap_bytes(self) -> int:
        """The most KV one worker lends under DistKV: lendCapFraction of its KV capacity (0 when off)."""
        if not self.distkv.enabled:
            return 0
        return int(self.distkv.lend_cap_fraction * self.kv_capacity_per_worker_bytes())

    def memory_budget_bytes(self) -> int:
        """An elastic worker's pool for KV and activations: its KV capacity plus the activation reserve
        a static split keeps, within the GPUs' memory less the weights."""
        cap = self.capacity
        total_bytes = quantity_bytes(cap.gpu_memory) * self.gpus_per_worker
        reserve_bytes = total_bytes - int(total_bytes * (1 - cap.activation_reserve_fraction))
        ceiling = total_bytes - (quantity_bytes(cap.model_weights) if cap.model_weights is not None else 0)
        return min(self.kv_capacity_per_worker_bytes() + reserve_bytes, ceiling)

    def kv_capacity_per_worker_bytes(self) -> int:
        """MELL's C for this pool, given or derived (see CapacitySpec)."""
        cap = self.capacity
        total_bytes = quantity_bytes(cap.gpu_memory) * self.gpus_per_worker
        if cap.kv_capacity_per_worker is not None:
            given_bytes = quantity_bytes(cap.kv_capacity_per_worker)
            if given_bytes > total_bytes:
                raise ValueError("capacity.kvCapacityPerWorker exceeds capacity.gpuMemory x gpusPerWorker")
            return given_bytes
        if cap.model_weights is None:
            raise ValueError("set capacity.kvCapacityPerWorker, or capacity.modelWeights so it can be derived")
        # The reserve is what is left of memory after the usable fraction, as vLLM's
        # gpu_memory_utilization leaves it; C itself is the core's one formula (no block rounding
        # here: the spec does not know the model's KV bytes per token).
        reserve_bytes = total_bytes - int(total_bytes * (1 - cap.activation_reserve_fraction))
        try:
            return kv_capacity_bytes(total_bytes, quantity_bytes(cap.model_weights), reserve_bytes)
        except ValueError:
            raise ValueError("capacity.modelWeights leave no room for KV cache after the activation reserve") from None


class Condition(_Model):
    """A status condition, shaped like metav1.Condition."""

    type: Annotated[str, StringConstraints(max_length=316)]
    status: Literal["True", "False", "Unknown"]
    reason: Annotated[str, StringConstraints(max_length=1024)] = ""
    message: Annotated[str, StringConstraints(max_length=32768)] = ""
    last_transition_time: datetime | None = None
    observed_generation: int | None = None


class RouteEntry(_Model):
    """Which worker takes the next new request of a MELL size class."""

    size_class: RoutedSizeClassName
    worker: Annotated[str, StringConstraints(max_length=253)]


# Bounds on status.distkv's lists, so that a large pool's status stays a valid object (the API server
# refuses a status over maxItems, and every object shares etcd's 1.5 MiB): the operator publishes
# at most this many of each, in their sorted order.
MAX_DISTKV_ENTRIES = 4096
# Creditors listed per worker: the paper's gManager proposes three per contract round (§4.4); a
# standing list lets a borrower that is refused go on to the next without waiting for an epoch.
MAX_CREDITOR_CANDIDATES = 8

PodNameText = Annotated[str, StringConstraints(max_length=253)]


class DebtEntry(_Model):
    """`bytes` of the debtor's KV live in blocks the creditor lent (the debtor reports it)."""

    debtor: PodNameText
    creditor: PodNameText
    bytes: int = Field(ge=0)


class SpanEntry(_Model):
    """A request whose KV spans workers: `borrowedBytes` of it live at creditors of its worker."""

    request: Annotated[str, StringConstraints(max_length=256)]
    worker: PodNameText
    borrowed_bytes: int = Field(ge=0)


class CreditorEntry(_Model):
    """A worker that can lend now, and how much: where a borrower opens a lease (its migration port)."""

    pod: PodNameText
    address: Annotated[str, StringConstraints(max_length=64)]
    lendable_bytes: int = Field(ge=0)


class CandidateEntry(_Model):
    """The contract protocol's answer (§4.4) for one worker: creditors to try, best first."""

    worker: PodNameText
    creditors: list[CreditorEntry] = Field(default_factory=list, max_length=MAX_CREDITOR_CANDIDATES)


class RecallEntry(_Model):
    """DGFM's order to one debtor (§4.5): bring `bytes` of its KV home from `creditor`, so that what it
    owes there comes down to `downToBytes` (the debt after the swap). The target makes the order safe to
    read twice: a debtor that already owes no more than it recalls nothing."""

    worker: PodNameText
    creditor: PodNameText
    bytes: int = Field(ge=0)
    down_to_bytes: int = Field(default=0, ge=0)


class DgfmStatus(_Model):
    """The last epoch's DGFM (§4.5): debt cycles found, the KV their recall-and-swap moves, and the
    recalls the workers carry out (none with spec.distkv.dgfm false). `generation` counts changes of
    the recalls, so a worker carries out each set once however often it reads the status."""

    swaps: int = Field(default=0, ge=0)
    swapped_bytes: int = Field(default=0, ge=0)
    generation: int = Field(default=0, ge=0)
    recalls: list[RecallEntry] = Field(default_factory=list, max_length=MAX_DISTKV_ENTRIES)


class DistKVStatus(_Model):
    """The gManager's view of KV borrowing in the pool, published while spec.distkv.enabled."""

    lent_bytes: int = Field(default=0, ge=0, description="KV the workers say they lend now.")
    borrowed_bytes: int = Field(default=0, ge=0, description="KV the workers say their requests hold at others.")
    debts: list[DebtEntry] = Field(default_factory=list, max_length=MAX_DISTKV_ENTRIES)
    spans: list[SpanEntry] = Field(default_factory=list, max_length=MAX_DISTKV_ENTRIES)
    candidates: list[CandidateEntry] = Field(default_factory=list, max_length=MAX_DISTKV_ENTRIES)
    dgfm: DgfmStatus = Field(default_factory=DgfmStatus)


class LLMPoolStatus(_Model):
    """What the operator observed and decided at its last epoch."""

    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list, max_length=16)
    workers: int = Field(default=0, description="Live worker pods; in a disaggregated pool, the decode workers (MELL's GPUs).")
    ready_workers: int = Field(default=0, description="Ready worker pods; in a disaggregated pool, the decode workers.")
    desired_workers: int = Field(
        default=0, description="Worker pods the scheduler wants; in a disaggregated pool, the decode workers."
    )
    prefill_workers: int = Field(default=0, description="Live prefill worker pods (disaggregated pools).")
    ready_prefill_workers: int = Field(default=0, description="Ready prefill worker pods (disaggregated pools).")
    desired_prefill_workers: int = Field(
        default=0, description="Prefill worker pods the prompt tokens queued on them call for (disaggregated pools)."
    )
    kv_transfers: int = Field(
        default=0, ge=0,
        description="KV hand-overs from prefill to decode workers, summed from the prefill workers' reports "
        "(each counts since it started; a deleted worker's count goes with it).",
    )
    gpus_in_use: int = 0
    lower_bound_gpus: int = 0
    kv_utilization_percent: int = Field(default=0, ge=0, le=100)
    migrations_in_flight: int = 0
    kv_capacity_per_worker_bytes: int = Field(
        default=0, ge=0, description="The KV capacity per worker MELL plans with: the smallest the workers report."
    )
    cpu_buffer_bytes: int = Field(default=0, ge=0, description="KV parked in the workers' CPU buffers (elastic memory).")
    held_requests: int = Field(default=0, ge=0, description="Requests the router holds for want of a Ready worker.")
    last_woken_at: str | None = Field(default=None, description="When held requests last woke the pool from zero workers.")
    routing_table: list[RouteEntry] = Field(default_factory=list, max_length=4)
    distkv: DistKVStatus | None = Field(default=None, description="DistKV borrowing (only while spec.distkv.enabled).")
    selector: Annotated[str, StringConstraints(max_length=1024)] = Field(
        default="", description="Label selector of the pool's worker pods (for the scale subresource)."
    )


class LLMPool(_Model):
    """A pool of GPU worker pods serving one model, packed by MELL."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"self.metadata.name.size() <= {MAX_POOL_NAME_LENGTH}",
                    "message": f"metadata.name must be at most {MAX_POOL_NAME_LENGTH} characters "
                    "(it prefixes worker pod and Service names)",
                },
                {
                    "rule": f"self.metadata.name.matches('{DNS_1035_LABEL}')",
                    "message": "metadata.name must be a DNS-1035 label: lower-case letters, digits and '-', "
                    "starting with a letter",
                },
            ]
        }
    )
    kind: ClassVar[str] = "LLMPool"
    plural: ClassVar[str] = "llmpools"
    short_names: ClassVar[tuple[str, ...]] = ("llmp",)

    spec: LLMPoolSpec
    status: LLMPoolStatus | None = None


# ------------------------------------------------------------------------------------- KVMigration


MigrationReason = Literal["Allocate", "Depart", "Update", "Rebalance", "Consolidate", "Drain", "Retry"]


class KVMigrationSpec(_Model):
    """One request moved from one worker to another, as planned by the operator. Immutable."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": "self == oldSelf", "message": "spec is immutable; create a new KVMigration"},
                {
                    "rule": "self.sourcePod != self.targetPod",
                    "message": "targetPod must differ from sourcePod",
                    "fieldPath": ".targetPod",
                },
            ]
        }
    )

    pool: Annotated[str, StringConstraints(min_length=1, max_length=MAX_POOL_NAME_LENGTH, pattern=DNS_1035_LABEL)]
    request_id: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    source_pod: PodName
    target_pod: PodName
    # The one enum of move modes (kvfleet.mell.migration): the planner's output is this field's value.
    mode: MoveMode = Field(
        description="kv copies the KV cache; token re-prefills; hybrid copies full blocks and re-prefills the tail."
    )
    expected_bytes: int | None = Field(default=None, ge=0, description="KV bytes the copy should move.")
    expected_tokens: int | None = Field(default=None, ge=0, description="Tokens the destination holds after the move.")
    reason: MigrationReason = Field(
        description="The scheduler operation that planned the move (MELL Fig. 10, the default policy's "
        "consolidation, or the baseline's rebalance)."
    )
    epoch: int | None = Field(default=None, ge=0, description="The scheduling epoch that planned it.")

    @model_validator(mode="after")
    def _distinct(self) -> KVMigrationSpec:
        if self.source_pod == self.target_pod:
            raise ValueError("targetPod must differ from sourcePod")
        return self


class KVMigrationStatus(_Model):
    """Progress of one migration, written by the source worker and the operator."""

    phase: Literal["Pending", "Transferring", "Succeeded", "Failed"] = "Pending"
    start_time: datetime | None = None
    completion_time: datetime | None = None
    bytes_moved: int = Field(default=0, ge=0)
    tokens_moved: int = Field(default=0, ge=0)
    downtime_seconds: float | None = Field(default=None, ge=0, description="Time the request made no progress.")
    downtime: Annotated[str, StringConstraints(max_length=32)] = Field(
        default="", description="downtimeSeconds for people, e.g. 35ms."
    )
    attempts: int = Field(default=0, ge=0)
    message: ShortText = ""


class KVMigration(_Model):
    """One live request migration, visible in `kubectl get kvmigrations`."""

    kind: ClassVar[str] = "KVMigration"
    plural: ClassVar[str] = "kvmigrations"
    short_names: ClassVar[tuple[str, ...]] = ("kvmig",)

    spec: KVMigrationSpec
    status: KVMigrationStatus | None = None

