"""DistKV: a request longer than one worker's memory keeps part of its KV in blocks other workers lend it,
and attends over them by shipping its queries there (docs/distkv.md), after Infinite-LLM ("Infinite-LLM:
Efficient LLM Service for Long Context with DistAttention and Distributed KVCache", arXiv 2401.02669). `wire` is the conversation on the migration port, `lender` its
serving side (rManager's, over an engine's `KVLending`), `borrower` the side of the request's worker.
"""
