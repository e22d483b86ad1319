"""The contract between clients, the router and the workers: the OpenAI protocol and its HTTP scaffolding.

The router and every worker speak the same OpenAI subset (`openai_api`), cut completions at stop
strings the same way (`stops`), and talk to each other with the same headers, request ids, errors,
probes and server-sent events (`httpapi`). That code belongs to neither side, so it lives here, once,
and both import it. It is importable without torch, transformers, an engine, kubernetes or kopf: the
router runs beside the workers, not on a GPU, and must not pull the model runtime in through it.
"""
