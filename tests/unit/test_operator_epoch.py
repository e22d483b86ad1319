"""The operator's epoch adapter: reports become MELL events, differences become migration orders."""

from __future__ import annotations

from kvfleet.api.reports import KVLoadReport, RequestLoad
from kvfleet.mell import MellDefaultConfig, MellPaperConfig, PolicyConfig
from kvfleet.operator.epoch import PoolScheduler, WorkerView

C = 1200  # bytes of KV per worker; the classes: L > 600, M > 400, S > 300, T > 150


def report(*requests: tuple[str, int]) -> KVLoadReport:
    reqs = [RequestLoad(id=rid, kv_bytes=size, tokens=size // 10, size_class="T") for rid, size in requests]
    return KVLoadReport(capacity_bytes=C, used_bytes=sum(s for _, s in requests), requests=reqs, sequence=1)


def worker(index: int, *requests: tuple[str, int], gpu: bool = True, ready: bool = True) -> WorkerView:
    return WorkerView(f"p-worker-{index}", f"gpu-{index}" if gpu else None, index, "node-0", "zone-0", ready, report(*requests))


def scheduler() -> PoolScheduler:
    return PoolScheduler("mell", PolicyConfig(capacity_bytes=C))


def test_first_arrival_activates_a_gpu_that_no_pod_serves_yet() -> None:
    sched = scheduler()
    # The router put r1 on an unbound floor pod: MELL activates gpu-0, which no pod serves yet.
    out = sched.epoch([worker(0, ("r1", 700), gpu=False)], {}, now_s=1.0)
    assert out.unserved_gpu_ids == ("gpu-0",)
    assert out.num_deferred_moves == 1 and out.moves == ()
    assert (out.used_bytes, out.lower_bound_gpus, out.active_gpus, out.num_events) == (700, 1, 1, 1)


def test_report_matching_the_plan_needs_no_move() -> None:
    sched = scheduler()
    sched.epoch([worker(0, ("r1", 700), gpu=False)], {}, now_s=1.0)
    out = sched.epoch([worker(0, ("r1", 700))], {}, now_s=2.0)
    assert out.moves == () and out.unserved_gpu_ids == () and out.num_events == 0


def test_misplaced_arrival_is_moved_where_allocate_puts_it() -> None:
    sched = PoolScheduler.rebuild("mell", PolicyConfig(capacity_bytes=C),
                                  [worker(0, ("big", 700)), worker(1, ("other", 700))])
    # Two L-requests fill two GPUs; a T-request the router put on worker 1 belongs, by MELL's Allocate T
    # (the L-GPU of highest priority; ties go to the older GPU), on worker 0.
    out = sched.epoch([worker(0, ("big", 700)), worker(1, ("other", 700), ("t", 200))], {}, now_s=1.0)
    assert [(m.request_id, m.source_pod, m.target_pod, m.size_bytes, m.reason) for m in out.moves] == [
        ("t", "p-worker-1", "p-worker-0", 200, "Allocate")]


def test_a_router_misplaced_arrival_counts_as_moved_for_the_default_policy() -> None:
    sched = PoolScheduler.rebuild("mell", PolicyConfig(capacity_bytes=C),
                                  [worker(0, ("big", 700)), worker(1, ("other", 300))])
    # The router put t on worker 1; Allocate (best fit) holds it on worker 0: a move is ordered, and the
    # policy treats t as just moved (not moved again by choice for min_move_interval_s).
    out = sched.epoch([worker(0, ("big", 700)), worker(1, ("other", 300), ("t", 400))], {}, now_s=7.0)
    assert [(m.request_id, m.target_pod, m.reason) for m in out.moves] == [("t", "p-worker-0", "Allocate")]
    assert sched.policy.snapshot().moved_at_s == ()  # planned, not yet ordered
    sched.ordered([m.request_id for m in out.moves], 7.5)  # its KVMigration was made
    assert sched.policy.snapshot().moved_at_s == (("t", 7.5),)
    # A request placed where Allocate wants it (worker 0 is full once t lands there) is not marked.
    out = sched.epoch([worker(0, ("big", 700)), worker(1, ("other", 300), ("t", 400), ("u", 100))],
                      {"t": "p-worker-0"}, now_s=8.0)
    assert out.moves == () and sched.policy.snapshot().moved_at_s == (("t", 7.5),)


def test_a_request_its_worker_says_is_finishing_is_not_moved() -> None:
    def view(index: int, *requests: tuple[str, int, bool]) -> WorkerView:
        reqs = [RequestLoad(id=rid, kv_bytes=size, tokens=size // 10, size_class="T", finishing=True if ending else None)
                for rid, size, ending in requests]
        return WorkerView(f"p-worker-{index}", f"gpu-{index}", index, "node-0", "zone-0", True,
                          KVLoadReport(capacity_bytes=C, used_bytes=sum(r.kv_bytes for r in reqs), requests=reqs, sequence=1))

    def fresh() -> PoolScheduler:
        return PoolScheduler.rebuild("mell", PolicyConfig(capacity_bytes=C),
                                     [view(0, ("big", 700, False)), view(1, ("other", 300, False))])

    # t is misplaced as in the test above; finishing, it stays (a deferred move) until it ends.
    out = fresh().epoch([view(0, ("big", 700, False)), view(1, ("other", 300, False), ("t", 400, True))], {}, now_s=1.0)
    assert out.moves == () and out.num_deferred_moves == 1
    out = fresh().epoch([view(0, ("big", 700, False)), view(1, ("other", 300, False), ("t", 400, False))], {}, now_s=1.0)
    assert [m.request_id for m in out.moves] == ["t"]


def test_in_flight_requests_are_neither_finished_nor_moved_again() -> None:
    sched = PoolScheduler.rebuild("mell", PolicyConfig(capacity_bytes=C), [worker(0, ("a", 700)), worker(1, ("b", 200))])
    # b is being moved to worker 0 and neither pod reports it this epoch.
    out = sched.epoch([worker(0, ("a", 700)), worker(1)], {"b": "p-worker-0"}, now_s=1.0)
    assert "b" in sched.sizes and out.num_events == 0 and out.moves == ()


def test_finished_requests_release_their_empty_worker() -> None:
    sched = PoolScheduler.rebuild("mell", PolicyConfig(capacity_bytes=C), [worker(0, ("a", 700)), worker(1, ("b", 700))])
    out = sched.epoch([worker(0, ("a", 700)), worker(1)], {}, now_s=1.0)
    assert out.released_pods == ("p-worker-1",)
    assert out.active_gpus == 1 and out.lower_bound_gpus == 1


def test_growth_is_an_update_and_stale_smaller_reports_are_ignored() -> None:
    sched = PoolScheduler.rebuild("mell", PolicyConfig(capacity_bytes=C), [worker(0, ("a", 200))])
    assert sched.epoch([worker(0, ("a", 180))], {}, now_s=1.0).num_events == 0
    assert sched.epoch([worker(0, ("a", 350))], {}, now_s=2.0).num_events == 1
    assert sched.sizes["a"] == 350


def test_rebuild_bundles_tiny_requests_and_keeps_activation_order() -> None:
    # MELL's multi-items (§VI-C) are Fig. 10's: the paper's policy keeps them; the default splits them.
    workers = [worker(3, ("x", 100), ("y", 100), ("z", 100)), worker(1, ("l", 700))]
    sched = PoolScheduler.rebuild("mell-paper", PolicyConfig(capacity_bytes=C), workers)
    snap = sched.policy.snapshot()
    assert [g.gpu_id for g in snap.gpus] == ["gpu-1", "gpu-3"]  # creation order, not list order
    bundles = sorted(tuple(r for r, _ in i.members) for i in snap.items if i.is_bundle)
    assert bundles == [("x", "y", "z")]  # 300 <= C/4
    assert snap.next_gpu_index == 4
    default = PoolScheduler.rebuild("mell", PolicyConfig(capacity_bytes=C), workers).policy.snapshot()
    assert not any(i.is_bundle for i in default.items) and len(default.items) == 4


def test_the_default_policys_routes_are_best_fit_with_headroom() -> None:
    # C = 1000: gpu-0 holds 700, gpu-1 450. A T-request (187) fits gpu-0 with 5% headroom (the fullest
    # that does); an M-request (416) only gpu-1; an L-request (750) none: a new GPU.
    sched = PoolScheduler.rebuild("mell", PolicyConfig(capacity_bytes=C), [worker(0, ("big", 700)), worker(1, ("m", 450))])
    routes = sched.routes()
    assert routes == {"T": "gpu-0", "S": "gpu-0", "M": "gpu-1", "L": "gpu-2"}


def test_routes_preview_allocate_without_changing_the_state() -> None:
    sched = PoolScheduler.rebuild("mell-paper", PolicyConfig(capacity_bytes=C), [worker(0, ("big", 700)), worker(1, ("m", 450))])
    before = sched.policy.snapshot()
    routes = sched.routes()
    assert sched.policy.snapshot() == before
    # A T-request joins an L-GPU (Allocate T); an L-request needs a GPU of its own, a new one.
    assert routes["T"] == "gpu-0" and routes["L"] == "gpu-2"
    assert set(routes) == {"L", "M", "S", "T"}


def test_rebuild_leaves_an_overfilled_workers_excess_to_be_allocated_afresh() -> None:
    # The router put three L-requests on one worker; a restarted operator must still spread them.
    sched = PoolScheduler.rebuild("mell", PolicyConfig(capacity_bytes=C), [worker(0, ("a", 700), ("b", 700), ("c", 700))])
    assert sched.sizes == {"a": 700}
    out = sched.epoch([worker(0, ("a", 700), ("b", 700), ("c", 700))], {}, now_s=1.0)
    assert out.num_events == 2 and out.unserved_gpu_ids == ("gpu-1", "gpu-2") and out.num_deferred_moves == 2


def test_the_pools_priority_weights_scale_mells_defaults() -> None:
    from kvfleet.api.models import LLMPoolSpec
    from kvfleet.api.scheduling import scheduler_config

    def config(**scheduling: object) -> PolicyConfig:
        return scheduler_config(LLMPoolSpec.model_validate({
            "model": {"name": "m", "path": "/m"}, "capacity": {"kvCapacityPerWorker": "1Gi"},
            "scheduling": scheduling}))

    # The default policy plans within the pool's communication boundary (10G/s x a 5 s epoch).
    default = MellDefaultConfig(capacity_bytes=2**30, intra_node_move_budget_bytes=50 * 10**9,
                                inter_node_move_budget_bytes=50 * 10**9)
    assert config() == default
    # The weights are those of MELL's GPU priority, which mell-paper ranks GPUs by.
    paper = config(policy="mell-paper")
    assert paper == MellPaperConfig(capacity_bytes=2**30)
    tuned = config(policy="mell-paper", workloadWeight=2.0, distanceWeight=0.0)
    assert isinstance(tuned, MellPaperConfig) and isinstance(paper, MellPaperConfig)
    assert (tuned.weight_free, tuned.weight_requests) == (2 * paper.weight_free, 2 * paper.weight_requests)
    assert (tuned.weight_same_node, tuned.weight_same_zone) == (0.0, 0.0)
    # The config is the operator's rebuild key: changing a weight must change it.
    assert tuned != paper and tuned != config(policy="mell-paper", workloadWeight=2.0)


def test_the_capacity_planned_with_is_the_smallest_a_ready_worker_reports_with_a_5_percent_band() -> None:
    from kvfleet.operator.epoch import capacity_to_plan, reported_capacity_bytes

    def sized(index: int, capacity: int, *, gpu: bool = True, ready: bool = True) -> WorkerView:
        view = worker(index, gpu=gpu, ready=ready)
        assert view.report is not None
        return WorkerView(view.pod_name, view.gpu_id, index, "node-0", "zone-0", ready,
                          view.report.model_copy(update={"capacity_bytes": capacity}))

    assert reported_capacity_bytes([]) is None
    assert reported_capacity_bytes([sized(0, 1500), sized(1, 1300), sized(3, 800, ready=False)]) == 1300
    assert reported_capacity_bytes([sized(0, 1500), sized(2, 900, gpu=False)]) == 900  # an idle floor pod counts
    assert capacity_to_plan(1200, None) == 1200
    assert capacity_to_plan(1200, 1259) == 1200  # under 5%: jitter of activations, no re-plan
    assert capacity_to_plan(1200, 1260) == 1260
    assert capacity_to_plan(1200, 1140) == 1140


def test_a_replan_keeps_requests_in_place_and_when_they_were_moved() -> None:
    workers = [worker(0, ("a", 700), ("b", 400)), worker(1, ("c", 700))]
    sched = PoolScheduler.rebuild("mell", PolicyConfig(capacity_bytes=C), workers)
    assert sched.epoch(workers, {}, now_s=1.0).moves == ()
    sched.ordered(["b"], 0.5)
    # A little more room: requests stay where they are (the re-plan itself orders no move).
    roomier = sched.replanned(C * 11 // 10, workers)
    assert roomier.policy.snapshot().moved_at_s == (("b", 0.5),)
    assert roomier.epoch(workers, {}, now_s=2.0).moves == ()
    # Twice the room: MELL packs the pool onto one GPU, and the lower bound follows the new C.
    grown = sched.replanned(2 * C, workers)
    assert grown.config.capacity_bytes == 2 * C
    out = grown.epoch(workers, {}, now_s=2.0)
    assert [(m.request_id, m.target_pod, m.reason) for m in out.moves] == [("c", "p-worker-0", "Consolidate")]
    assert out.lower_bound_gpus == 1


def test_a_request_reading_shared_blocks_is_packed_by_its_own_and_moved_whole() -> None:
    # On worker 1, "s" reads 150 bytes of prompt-prefix blocks counted under "other" (its worker's
    # prefix cache): MELL packs it at 250 (worker 1 holds 300 + 250, each block once), and a move of
    # it carries, and its target must hold, all 400.
    shared = RequestLoad(id="s", kv_bytes=250, tokens=40, size_class="T", shared_bytes=150)
    assert shared.whole_kv_bytes == 400
    sched = PoolScheduler.rebuild("mell", PolicyConfig(capacity_bytes=C),
                                  [worker(0, ("big", 700)), worker(1, ("other", 300))])
    w1 = worker(1, ("other", 300))
    w1 = WorkerView(w1.pod_name, w1.gpu_id, w1.created_order, w1.node_name, w1.zone, w1.ready,
                    KVLoadReport(capacity_bytes=C, used_bytes=550, sequence=2,
                                 requests=[*report(("other", 300)).requests, shared]))
    out = sched.epoch([worker(0, ("big", 700)), w1], {}, now_s=7.0)
    assert sched.sizes["s"] == 250 and out.used_bytes == 700 + 300 + 250
    assert [(m.request_id, m.target_pod, m.size_bytes) for m in out.moves] == [("s", "p-worker-0", 400)]
