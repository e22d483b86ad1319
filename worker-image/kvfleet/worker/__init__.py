"""The worker pod's runtime: an engine (builtin or vLLM) behind an OpenAI-compatible agent.

The agent serves requests, accounts every request's KV cache, and reports the pod's KV load to the
Kubernetes API so the operator can pack pods with MELL (docs/worker.md).
"""
