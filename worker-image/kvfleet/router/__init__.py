"""The pool's router: one OpenAI-compatible front door per LLMPool (docs/router.md).

It places each new request where MELL's Allocate would (the pool's routing table, then the rule
itself on its live view of the workers), relays the worker's token stream to the client, follows a
request across a live migration, and resumes it elsewhere by token re-prefill when its worker dies.
It never imports torch, an engine or kvfleet.worker: it runs beside the workers, not on a GPU, and
what it shares with them (the OpenAI protocol, the HTTP scaffolding) is in kvfleet.serving.
"""
