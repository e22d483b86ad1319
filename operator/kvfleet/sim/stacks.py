"""Whole serving stacks in the simulator: what a platform team runs today against kvfleet's, and kvfleet's
with one technique turned off at a time (`kvfleet simulate --stack`, bench/fleet.py).

A policy alone (`--policies`) answers "which packer needs fewest GPUs"; users choose a stack, whose
bill also depends on how much of a GPU's memory holds KV and on how replicas are scaled. Each stack
here is a policy, a KV capacity per GPU and a scale-down rule:

- **today**: vLLM with its static memory split, a least-loaded router, no migration, replicas sized by
  a HorizontalPodAutoscaler on mean KV-cache usage (the `hpa` policy, kvfleet/mell/kv_autoscaler.py).
  A replica is deleted once drained; the HPA's scale-down stabilization window is the pool's
  scale-down delay, so both stacks wait as long before giving a GPU back.
- **kvfleet**: the default policy (`mell`: packing, migration, consolidation), the operator's scaling
  (a GPU starts when a request fits on none, goes the scale-down delay after it empties) and elastic
  memory (eLLM): KV may use what the step's activations leave.
- **today+elastic**, **kvfleet-static**, **kvfleet-no-migration**, **kvfleet-no-prompt-tree**: one
  technique added to today or taken from kvfleet, so each one's share of the saving is its own row.
- **kvfleet+budgets**: kvfleet with the default policy's per-request growth room, from each request's
  final size (the trace's output in the replay). A live pool cannot run it yet: workers' reports carry
  no output budget, so `kvfleet` runs the policy as a live operator does, with the pool's headroom.

KV capacity per GPU (`capacity_setup`). vLLM sizes its KV cache once, at start: gpu_memory_utilization
(0.9) of the GPU less the weights and less the peak activations of a profiling step of
max_num_batched_tokens tokens over max_num_seqs sequences (vLLM 0.32's OpenAI server defaults, 2048 and
256, on GPUs other than H100/H200-class; vllm/engine/arg_utils.py). That peak is reserved for good and
idle whenever the batch decodes. An elastic worker keeps the same 10% for the CUDA context and the
allocator, and reserves activations only for the largest decode step (max_num_seqs tokens over as many
sequences): a prefill chunk is admitted into the room KV leaves (eLLM's Algorithm 1), which this model
does not charge for.

Prefix caching, on a trace with prompt block hashes (the bundled Mooncake conversation trace) and the
replay's prefix cache (`--prefix-cache`): every worker keeps finished prompts in the KV memory its
requests leave free, in both stacks (vLLM's automatic prefix caching does the same). Today's router is
cache-blind; kvfleet's routes by a prompt tree (`prompt_tree`: MemServe §6, as a pool's router does),
so a conversation's next turn finds its history. The Azure traces carry no prompt content: on them no
cache hit can be counted and the stacks run without it. Disaggregation is not part of the stacks
(docs/simulator.md, "Two stacks").
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.mell.cluster import PolicyConfig
from kvfleet.mell.policy import policy_config
from kvfleet.sim.hardware import GpuSpec, ModelShape, step_activation_bytes
from kvfleet.sim.speed_model import Setup, make_setup, tpot_knobs

# vLLM 0.32's defaults for its OpenAI server on GPUs below H100 class (A100, RTX 4090).
VLLM_MAX_NUM_BATCHED_TOKENS = 2048
VLLM_MAX_NUM_SEQS = 256
# The HPA target a stack runs at unless told otherwise: KV usage 80%, leaving a fifth for growth.
DEFAULT_HPA_TARGET = 0.8

CAPACITIES = ("static", "elastic")


@dataclass(frozen=True)
class Stack:
    """One way of serving: the policy that places requests and sizes the pool, and the KV capacity per GPU.

    `hpa` stacks delete a replica once drained and take the scale-down delay as the HPA's stabilization
    window; the others keep an emptied GPU's pod for the delay, as an LLMPool does."""

    name: str
    policy: str
    capacity: str  # "static" (vLLM's split) or "elastic" (eLLM)
    description: str
    knobs: tuple[tuple[str, object], ...] = ()  # the policy's knobs where not its defaults
    # With the replay's prefix cache (--prefix-cache): whether its router routes by a prompt tree
    # (MemServe §6, as a pool's router does) or is cache-blind (a least-loaded router, as today's).
    prompt_tree: bool = False

    @property
    def hpa(self) -> bool:
        return self.policy == "hpa"


# The default policy as a live operator runs it: workers' reports carry no output budget, so it keeps
# the pool's growth headroom (kvfleet.mell.mell_default rule 6 falls back to it without final sizes).
_AS_LIVE = (("growth_estimate", "pool"),)

STACKS: dict[str, Stack] = {s.name: s for s in (
    Stack("today", "hpa", "static", "vLLM's static split, least-loaded router, no migration, HPA on KV usage"),
    Stack("today+elastic", "hpa", "elastic", "today, with elastic memory"),
    Stack("kvfleet-static", "mell", "static", "kvfleet without elastic memory", _AS_LIVE, prompt_tree=True),
    Stack("kvfleet-no-migration", "bf", "elastic", "kvfleet without migration (best-fit, the operator's scaling)"),
    Stack("kvfleet-no-prompt-tree", "mell", "elastic", "kvfleet with a cache-blind router (with --prefix-cache)",
          _AS_LIVE),
    Stack("kvfleet", "mell", "elastic", "kvfleet: default policy with migration, operator scaling, elastic memory, "
          "prompt-tree routing (with --prefix-cache)", _AS_LIVE, prompt_tree=True),
    Stack("kvfleet+budgets", "mell", "elastic", "kvfleet, with each request's output budget in its report "
          "(the default policy's per-request growth room; not carried by live reports yet)", prompt_tree=True),
)}


def parse_stacks(text: str) -> list[Stack]:
    """Comma-separated stack names, each once, in the order given."""
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in STACKS]
    if unknown or not names:
        raise ValueError(f"unknown stack {', '.join(unknown) or '(none)'}; choose from {', '.join(STACKS)}")
    return [STACKS[n] for n in names]


def activation_reserve_bytes(model: ModelShape, gpu: GpuSpec, capacity: str) -> int:
    """What a GPU keeps from KV beside the weights: 10% (gpu_memory_utilization 0.9) plus the activations
    the capacity model reserves (module docstring)."""
    if capacity == "static":
        activations = step_activation_bytes(model, VLLM_MAX_NUM_BATCHED_TOKENS, VLLM_MAX_NUM_SEQS)
    elif capacity == "elastic":
        activations = step_activation_bytes(model, VLLM_MAX_NUM_SEQS, VLLM_MAX_NUM_SEQS)
    else:
        raise ValueError(f"capacity {capacity!r}: one of {', '.join(CAPACITIES)}")
    return gpu.memory_bytes // 10 + activations


def capacity_setup(name: str, model: ModelShape, gpu: GpuSpec, capacity: str) -> Setup:
    """The setup `name` with C as the capacity model gives it."""
    return make_setup(name, model, gpu, activation_reserve_bytes(model, gpu, capacity))


@dataclass(frozen=True)
class StackRun:
    """A stack made ready for one setup: the setup at the stack's capacity, its policy's config, and how
    long an emptied GPU's pod stays (`simulate`'s scale_down_delay_s)."""

    stack: Stack
    setup: Setup
    config: PolicyConfig
    scale_down_delay_s: float


def prepare(stack: Stack, setup_name: str, model: ModelShape, gpu: GpuSpec, *, scale_down_delay_s: float,
            hpa_target: float = DEFAULT_HPA_TARGET, tpot_ms: float | None = None) -> StackRun:
    """`stack` on `model` x `gpu`. An `hpa` stack deletes a replica once drained, with the scale-down
    delay as its HPA's stabilization window; the default policy keeps a TPOT objective as its load cap
    (ValueError where no GPU can meet it)."""
    setup = capacity_setup(setup_name, model, gpu, stack.capacity)
    if stack.hpa:
        config = policy_config(stack.policy, setup.capacity_bytes, target_utilization=hpa_target,
                               stabilization_s=scale_down_delay_s)
        return StackRun(stack, setup, config, 0.0)
    knobs: dict[str, object] = dict(stack.knobs)
    if tpot_ms is not None and stack.policy == "mell":
        knobs.update(tpot_knobs(setup, tpot_ms))
    return StackRun(stack, setup, policy_config(stack.policy, setup.capacity_bytes, **knobs), scale_down_delay_s)
