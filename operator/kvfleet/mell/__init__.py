"""MELL: the pure KV-cache scheduling core (papers/mell.txt). No kubernetes, kopf, torch, vllm or triton."""
