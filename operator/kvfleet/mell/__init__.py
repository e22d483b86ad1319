"""MELL: the pure KV-cache scheduling core. No kubernetes, kopf, torch, vllm or triton.

After MELL ("MELL: Memory-Efficient Large Language Model Serving via Multi-GPU KV Cache Management",
Liu et al.).

`make_policy(name, capacity_bytes=C)` gives MELL or a baseline, each with a config of its own
(`policy_config(name, C, **knobs)`); `policy.schedule(batch)` turns one epoch of events into a Plan. `plan_epoch` is the same as a pure function of a snapshot, and
`allocate_one` is MELL's Allocate for one new request on a snapshot (what the router calls).
`kvfleet.mell.debt` is the gManager of Infinite-LLM (§4.4-4.5): the debt ledger, creditor choice and DGFM.
"""

from kvfleet.mell.allocate import (
    AllocateDecision,
    GpuLoad,
    GpuTotals,
    allocate_on_snapshot,
    allocate_on_totals,
    allocate_one,
    cluster_snapshot,
)
from kvfleet.mell.cluster import ClusterPolicy, PolicyConfig
from kvfleet.mell.debt import (
    BlockMove,
    BorrowPlan,
    BorrowRequest,
    Debt,
    DebtLedger,
    DebtSwap,
    DgfmResult,
    Grant,
    InstanceAccount,
    LedgerError,
    WorkerDebtReport,
    blocks_needed_for_bytes,
    build_ledger,
    clear_refusals,
    creditor_candidates,
    debt_graph,
    eliminate_debt_cycles,
    find_cycle,
    find_cycle_from,
    free_blocks_for_bytes,
    locality_cost,
    plan_borrowing,
)
from kvfleet.mell.load_balance import LoadBalanceConfig
from kvfleet.mell.mell_default import MellDefaultConfig
from kvfleet.mell.mell_paper import MellPaperConfig
from kvfleet.mell.models import (
    Arrive,
    EventBatch,
    Finish,
    Grow,
    Migration,
    Placement,
    Plan,
    Span,
    kv_capacity_bytes,
    tpot_load_cap,
)
from kvfleet.mell.policy import POLICIES, make_policy, plan_epoch, policy_class, policy_config
from kvfleet.mell.size_classes import SizeClass, size_class
from kvfleet.mell.state import ClusterSnapshot

__all__ = [
    "POLICIES",
    "AllocateDecision",
    "Arrive",
    "BlockMove",
    "BorrowPlan",
    "BorrowRequest",
    "ClusterPolicy",
    "ClusterSnapshot",
    "Debt",
    "DebtLedger",
    "DebtSwap",
    "DgfmResult",
    "EventBatch",
    "Finish",
    "GpuLoad",
    "GpuTotals",
    "Grant",
    "Grow",
    "InstanceAccount",
    "LedgerError",
    "LoadBalanceConfig",
    "Migration",
    "Placement",
    "Plan",
    "MellDefaultConfig",
    "MellPaperConfig",
    "PolicyConfig",
    "SizeClass",
    "Span",
    "WorkerDebtReport",
    "allocate_on_snapshot",
    "allocate_on_totals",
    "allocate_one",
    "blocks_needed_for_bytes",
    "build_ledger",
    "clear_refusals",
    "cluster_snapshot",
    "creditor_candidates",
    "debt_graph",
    "eliminate_debt_cycles",
    "find_cycle",
    "find_cycle_from",
    "free_blocks_for_bytes",
    "kv_capacity_bytes",
    "locality_cost",
    "make_policy",
    "plan_borrowing",
    "plan_epoch",
    "policy_class",
    "policy_config",
    "size_class",
    "tpot_load_cap",
]
