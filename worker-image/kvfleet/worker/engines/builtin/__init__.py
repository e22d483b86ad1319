"""The builtin engine: plain torch, a paged KV cache, continuous batching, and every memory technique.

kvfleet needs an engine whose KV blocks it can read and write (live migration, elastic memory, KV
lending and borrowing, a prefix cache), and one that runs wherever torch does (tests, the demo, CPUs).
The engine-neutral mechanisms live once, outside this package (`kvfleet.worker.elastic`: the chunk
pool and its memory backends; `kvfleet.worker.distkv`: DistKV's wire and lease protocol;
`kvfleet.worker.migration`: the migration transport); the modules here adapt them to this engine:

| module | what it owns |
|---|---|
| engine.py | `BuiltinEngine`: the engine's life cycle and its step loop (the `Engine` contract of ../base.py) |
| model.py | the Llama forward pass and the paged KV cache's tensors |
| blocks.py | block accounting: the `KVSpace` protocol, the static free list, staged KV |
| scheduler.py | the requests, admission (one `admit`), preemption, continuous batching, kv_usage(); composed of a `KVSpace`, a `PrefixCache` and DistKV's `RemoteKVHooks`, passed in |
| prefix.py | the prefix cache part (MemServe): match / start / insert / evict / unlock over a `PromptTree` |
| sampling.py | vLLM's sampling parameters in its order (masks, penalties, logit_bias, min_p/top_k/top_p, raw logprobs), seeded (seed, position) draws, the structured-output hook (`TokenConstraint`) |
| migration.py | the KVMigratable calls: the object `capabilities.migration` hands out |
| elastic.py | elastic memory (eLLM): one chunk pool for KV and activations (`ElasticSpace`), §5.1's overlapped (un)mapping (`MappingOverlap`); `ElasticScheduler` replaces only the batch choice (Algorithm 1) and sizes the CPU buffer (Algorithm 2), composed of those parts and a `CpuBuffer` |
| cpu_buffer.py | eLLM's CPU buffer (§4.3.2, `CpuBuffer`): parked KV, offloaded prefills' sinks, their copies; with prefix caching the cache's host tier (`HostTierPrefixCache`) |
| lending.py | DistKV's lender side: blocks lent to requests of other workers (`capabilities.lending`) |
| borrowing.py | DistKV's borrower side: a request larger than the cache keeps its oldest KV in leases (`Lenders`: the scheduler's hooks) |

Importing this package imports no torch: `kvfleet.worker.engines.load_engine("builtin", ...)` imports
engine.py when a worker runs this engine.
"""
