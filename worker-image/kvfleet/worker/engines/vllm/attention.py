"""kvfleet's attention backend for vLLM: DistAttention partials over a plain block layout.

vLLM's own CPU attention returns each token's output only, not the log-sum-exp of its scores, so a
part of a request's KV held elsewhere (Infinite-LLM's DistKV: "Infinite-LLM: Efficient LLM Service
for Long Context with DistAttention and Distributed KVCache", section 4.2) could not be merged into
what vLLM computes. This backend computes every sequence's local part as a DistAttention partial,
(out, lse), through `kvfleet.kernels.dispatch`: the CPU's C decode kernel and the torch backend's
prefill here, the Triton kernels on CUDA. With the LSE, a part of the request's KV attended
elsewhere merges with this one exactly (ScaleReduce); that is what vLLM workers need to lend and
borrow KV as the builtin engine does.

The cache keeps vLLM's NHD layout (`KVCacheLayout.LBNHC`): a layer is [blocks, block_size, kv_heads,
2 x head_dim] with a token's K then V in one row, so K and V are plain strided views of the kernels'
[blocks, block_size, kv_heads, head_dim] and the KV connector copies blocks without asking a kernel
where it put them (connector.py PlainKVLayout; vLLM's CPU backend packs blocks per CPU ISA).

It is selected per engine (`VLLMOptions.attention = "distattention"`, the worker's `--attention
distattention`) and registered in every vLLM process by plugin.py. Decoder self-attention of plain
causal models only: sliding windows, ALiBi, soft caps, sinks and quantized caches are refused when
the model is built, with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvfleet.kernels import dispatch

# What vLLM's registry calls the backend (AttentionBackendEnum.CUSTOM; plugin.py registers it there).
BACKEND_NAME = "CUSTOM"


class KvfleetAttentionBackend(AttentionBackend):
    """The backend class vLLM resolves (plugin.py)."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[KvfleetAttentionImpl]:
        return KvfleetAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KvfleetMetadataBuilder]:
        return KvfleetMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBNHC,)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


@dataclass(frozen=True)
class KvfleetAttentionMetadata(AttentionMetadata):
    """One step's attention plan, shared by every layer: which query rows decode (one new token) and
    which prefill, with their block tables and lengths as the kernels take them."""

    num_actual_tokens: int
    # The decodes are the first rows (vLLM reorders the batch so: reorder_batch_threshold), so their
    # queries and outputs are slices, not copies.
    decodes_first: bool
    decode_rows: torch.Tensor         # long: query rows of the sequences with one new token
    decode_table: torch.Tensor        # int32 [decodes, blocks]
    decode_lens: torch.Tensor         # int32 [decodes]: tokens in the cache, the new one included
    prefill_rows: torch.Tensor        # long: query rows of the others, sequence by sequence
    prefill_table: torch.Tensor       # int32 [prefills, blocks]
    prefill_lens: torch.Tensor        # int32 [prefills]
    prefill_starts: torch.Tensor      # int32 [prefills + 1]: each one's rows within prefill_rows
    prefill_max_q_len: int
    block_size: int = 0
    # What DistKV borrowing makes of this step's tables (`local`), worked out by the first layer.
    local_plan: list[LocalPlan] = field(default_factory=list, compare=False)

    def local(self) -> LocalPlan:
        """The tables and lengths as the local attention takes them: a sequence whose oldest blocks moved
        to other workers (DistKV borrowing, borrowing.py) attends here over its blocks past them, and its
        remote part is merged after. vLLM's model runner keeps the moved blocks' old ids at the head of
        the sequence's table (as it does for what leaves a sliding window), so which sequences span comes
        from the EngineCore's borrowing, which the connector set for this step before the forward."""
        if self.local_plan:
            return self.local_plan[0]
        from kvfleet.worker.engines.vllm import borrowing

        core = borrowing.CORE
        plan = LocalPlan(self.decode_table, self.decode_lens, self.prefill_table, self.prefill_lens, ())
        if core is not None and core.spans:
            plan = _shifted(plan, core.spans, self.block_size)
        self.local_plan.append(plan)
        return plan


@dataclass(frozen=True)
class SpanRows:
    """A sequence of the step whose oldest KV is remote."""

    request_id: str                   # the agent's id (CoreBorrowing.attend)
    decode: bool
    index: int                        # among the decodes, or among the prefills


@dataclass(frozen=True)
class LocalPlan:
    decode_table: torch.Tensor
    decode_lens: torch.Tensor
    prefill_table: torch.Tensor
    prefill_lens: torch.Tensor
    spans: tuple[SpanRows, ...]


def _shifted(plan: LocalPlan, spans: Sequence[tuple[str, int, Sequence[int]]], block_size: int) -> LocalPlan:
    """`plan` with each spanning sequence's table row and length past its remote blocks: a row is the
    sequence's when its blocks from `remote_blocks` on are the sequence's local blocks."""
    tables = {True: plan.decode_table.clone(), False: plan.prefill_table.clone()}
    lens = {True: plan.decode_lens.clone(), False: plan.prefill_lens.clone()}
    found: list[SpanRows] = []
    for request_id, remote_blocks, local_blocks in spans:
        local = torch.tensor(list(local_blocks), dtype=tables[True].dtype)
        end = remote_blocks + len(local)
        for decode in (True, False):
            table = tables[decode]
            if table.shape[1] < end:
                continue
            # Its length must fall in its last local block too (a row's tail past its blocks is stale).
            fits = (lens[decode] > (end - 1) * block_size) & (lens[decode] <= end * block_size)
            match = ((table[:, remote_blocks:end] == local.to(table.device)).all(dim=1) & fits.to(table.device)
                     ).nonzero().flatten()
            if len(match):
                i = int(match[0])
                table[i] = torch.cat([table[i, remote_blocks:], table.new_zeros(remote_blocks)])
                lens[decode][i] -= remote_blocks * block_size
                found.append(SpanRows(request_id, decode, i))
                break
    return LocalPlan(tables[True], lens[True], tables[False], lens[False], tuple(found))


class KvfleetMetadataBuilder(AttentionMetadataBuilder[KvfleetAttentionMetadata]):
    # Decodes first (vLLM reorders the batch): their rows are then a prefix; the plan does not rely on it.
    reorder_batch_threshold: int | None = 1

    # vLLM declares the base class's __init__ abstract: every builder spells it out.
    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = int(kv_cache_spec.block_size)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KvfleetAttentionMetadata:
        meta = common_attn_metadata
        starts = meta.query_start_loc_cpu[: meta.num_reqs + 1].long()
        q_lens = starts[1:] - starts[:-1]
        seq_lens = meta.seq_lens[: meta.num_reqs].to(device="cpu", dtype=torch.int32)
        table = meta.block_table_tensor[: meta.num_reqs]
        device = table.device
        decodes = (q_lens == 1).nonzero().flatten()
        prefills = (q_lens > 1).nonzero().flatten()
        prefill_q = q_lens[prefills]
        prefill_rows = torch.cat([torch.arange(int(starts[i]), int(starts[i + 1])) for i in prefills.tolist()]) \
            if len(prefills) else torch.zeros(0, dtype=torch.long)
        prefill_starts = torch.zeros(len(prefills) + 1, dtype=torch.int32)
        torch.cumsum(prefill_q, 0, out=prefill_starts[1:])
        decode_starts = starts[decodes]
        return KvfleetAttentionMetadata(
            num_actual_tokens=meta.num_actual_tokens,
            decodes_first=bool(torch.equal(decode_starts, torch.arange(len(decodes)))),
            decode_rows=decode_starts.to(device), decode_table=table[decodes.to(device)].to(torch.int32),
            decode_lens=seq_lens[decodes].to(device),
            prefill_rows=prefill_rows.to(device), prefill_table=table[prefills.to(device)].to(torch.int32),
            prefill_lens=seq_lens[prefills].to(device), prefill_starts=prefill_starts.to(device),
            prefill_max_q_len=int(prefill_q.max()) if len(prefills) else 0, block_size=self.block_size)


def kv_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's view of a layer (logically [blocks, kv_heads, block_size, 2 x head_dim], laid out NHD) ->
    (rows [blocks, block_size, kv_heads, 2 x head_dim], K, V [blocks, block_size, kv_heads, head_dim])."""
    rows = kv_cache.permute(0, 2, 1, 3)
    head_dim = rows.shape[-1] // 2
    return rows, rows[..., :head_dim], rows[..., head_dim:]


class KvfleetAttentionImpl(AttentionImpl[KvfleetAttentionMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks: torch.Tensor | None = None,
                 **_: Any) -> None:
        refused = [what for what, present in (
            ("ALiBi", alibi_slopes is not None), ("a sliding window", sliding_window is not None),
            ("a logit soft cap", bool(logits_soft_cap)), ("attention sinks", sinks is not None),
            (f"a {kv_cache_dtype} KV cache", kv_cache_dtype != "auto"),
            (f"{attn_type} attention", attn_type != AttentionType.DECODER)) if present]
        if refused:
            raise NotImplementedError(f"kvfleet's DistAttention backend does not support {', '.join(refused)}; "
                                      "run this model with vLLM's own attention")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        self._layer_index: int | None = None   # from the layer's name, at the first remote merge

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """The step's new K and V into their slots (slot = block x block_size + offset; -1 pads)."""
        rows, _, _ = kv_views(kv_cache)
        flat = rows.reshape(-1, *rows.shape[2:])   # a view: the layer is contiguous in NHD order
        head_dim = flat.shape[-1] // 2
        count = min(len(slot_mapping), key.shape[0])
        slots = slot_mapping[:count].long()
        key, value = key[:count], value[:count]
        if count and bool((slots < 0).any()):
            keep = slots >= 0
            slots, key, value = slots[keep], key[keep], value[keep]
        flat[..., :head_dim].index_copy_(0, slots, key.to(flat.dtype))
        flat[..., head_dim:].index_copy_(0, slots, value.to(flat.dtype))

    def forward(self, layer: AttentionLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: KvfleetAttentionMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Each sequence's attention over its cached blocks, the step's tokens written before (output
        [tokens, heads, head_dim]). A sequence's local part is a DistAttention partial; with no other
        part its output is the partial's."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvfleet's DistAttention backend does not fuse output quantization")
        if attn_metadata is None:   # vLLM's warm-up and profiling runs
            return output
        plan = attn_metadata
        local = plan.local()
        # A spanning sequence's remote part is asked for first and computed where its KV lives while the
        # local parts are computed here (§4.6: overlapped); it is merged after.
        remote = [self._ask_remote(layer, span, plan, query) for span in local.spans]
        _, k_cache, v_cache = kv_views(kv_cache)
        decodes = len(plan.decode_rows)
        decode_lse = prefill_lse = None
        if decodes and plan.decodes_first:
            # fp32 outputs are written in place; others through the kernels' fp32 partial.
            in_place = output.dtype == torch.float32 and output.is_contiguous()
            # query is a view of the fused QKV projection; the kernels' contract asks a contiguous q.
            out, decode_lse = dispatch.micro_attention_decode(query[:decodes].contiguous(), k_cache, v_cache,
                                                              local.decode_table, local.decode_lens, scale=self.scale,
                                                              out=output[:decodes] if in_place else None)
            if not in_place:
                output[:decodes] = out
        elif decodes:
            out, decode_lse = dispatch.micro_attention_decode(query.index_select(0, plan.decode_rows), k_cache, v_cache,
                                                              local.decode_table, local.decode_lens, scale=self.scale)
            output.index_copy_(0, plan.decode_rows, out.to(output.dtype))
        if len(plan.prefill_rows):
            out, prefill_lse = dispatch.micro_attention_prefill(
                query.index_select(0, plan.prefill_rows), k_cache, v_cache, local.prefill_table, local.prefill_lens,
                plan.prefill_starts, max_q_len=plan.prefill_max_q_len, scale=self.scale)
            output.index_copy_(0, plan.prefill_rows, out.to(output.dtype))
        for span, (rows, collect) in zip(local.spans, remote, strict=True):
            first = span.index if span.decode else int(plan.prefill_starts[span.index])
            lse_all = decode_lse if span.decode else prefill_lse
            assert lse_all is not None
            self._merge_remote(span.request_id, collect, output, rows, lse_all[first:first + len(rows)])
        return output

    def _ask_remote(self, layer: AttentionLayer, span: SpanRows, plan: KvfleetAttentionMetadata,
                    query: torch.Tensor) -> tuple[torch.Tensor, Callable[[], tuple[torch.Tensor, torch.Tensor]]]:
        """A spanning sequence's query rows, and how to collect their attention over its remote KV."""
        from kvfleet.worker.engines.vllm import borrowing

        core = borrowing.CORE
        assert core is not None, "a span is found through the EngineCore's borrowing"
        if self._layer_index is None:
            from vllm.model_executor.models.utils import extract_layer_index

            self._layer_index = extract_layer_index(str(getattr(layer, "layer_name", "")))
        if span.decode:
            rows = plan.decode_rows[span.index:span.index + 1]
        else:
            rows = plan.prefill_rows[int(plan.prefill_starts[span.index]):int(plan.prefill_starts[span.index + 1])]
        return rows, core.submit(span.request_id, self._layer_index, query.index_select(0, rows))

    def _merge_remote(self, request_id: str, collect: Callable[[], tuple[torch.Tensor, torch.Tensor]],
                      output: torch.Tensor, rows: torch.Tensor, local_lse: torch.Tensor) -> None:
        """A borrowing sequence's local partial (already in `output`) merged with its remote part, which
        the agent's leases computed where the KV lives (borrowing.py; §4.2 ScaleReduce)."""
        from kvfleet.worker.engines.vllm import borrowing

        try:
            remote_out, remote_lse = collect()
        except Exception as err:  # its lender is gone: the step's output for it is dropped (borrowing.py)
            assert borrowing.CORE is not None
            borrowing.CORE.lose(request_id, str(err))
            return
        local_out = output.index_select(0, rows).float()
        merged, _ = dispatch.scale_reduce_pair(local_out, local_lse.float().contiguous(), remote_out.to(local_out.device),
                                               remote_lse.to(local_out.device))
        output.index_copy_(0, rows, merged.to(output.dtype))
