"""The vLLM engine: vLLM's AsyncLLM behind kvfleet's `Engine` contract, extended only through vLLM's seams.

| module | what it owns |
|---|---|
| engine.py | `VLLMEngine`: AsyncLLM in the worker's process, its KV usage, prefix caching, speed |
| connector.py | kvfleet's KV connector, which vLLM loads in its EngineCore (both its roles) |
| pipe.py | the authenticated local socket between the agent's process and the connector |
| migration.py | the agent's half of a KV move (the `KVMigratable` capability), spoken through the pipe |
| penalties.py | the logits processor vLLM loads to count a resumed request's earlier output in its penalties |
| elastic.py | elastic memory through the connector: the KV cache over an eTensor, the balloon, the CPU buffer |
| internals.py | every private vLLM name kvfleet uses, and the start-up check that they are still there |
| attention.py | kvfleet's DistAttention backend inside vLLM: (out, lse) partials over vLLM's NHD layout |
| plugin.py | registers attention.py in vLLM's processes (a vllm.general_plugins entry point) when asked |
| options.py | `VLLMOptions`, the engine's own settings (no vllm import) |

Importing this package imports no vllm: engine.py, connector.py, attention.py, penalties.py and
structured.py import it (internals.py and plugin.py when their functions run), and only a worker that
runs this engine (or vLLM's EngineCore, loading the connector, the processors and the attention
backend by module path) imports them.
"""
