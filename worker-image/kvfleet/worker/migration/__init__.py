"""Live migration of running requests between workers (docs/migration.md).

- `transport`: authenticated worker-to-worker frames (TCP on the CPU; the seam for NCCL/NIXL).
- `handoff`: the agent's side: stopping a request's stream at the source, continuing it at the target.
- `executor`: one migration end to end, in KV, token or hybrid mode, with its rollbacks; its parts:
  `source` (copy, stop, commit, roll back), `target` (take stages and the request in), `wire` (the
  frames between the two), `host` (what it needs from the agent), `result` (what it reports).
- `watcher`: the KVMigration objects naming this worker as the source, run and reported.
"""
