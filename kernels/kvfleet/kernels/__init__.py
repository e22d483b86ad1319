"""DistAttention kernels (Triton), their launchers and torch references (papers/infinite-llm-distattention.txt)."""
