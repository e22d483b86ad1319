"""The traces that kvfleet ships, so that `kvfleet simulate`, `kvfleet replay`, the demo and the
benchmarks run from a plain clone or an installed wheel, with no data beside them: the Azure LLM
inference traces (2023) and Mooncake's conversation trace.

They are the conversation and coding services' request traces of the Azure Public Dataset's "Azure
LLM inference trace 2023" (published with "Splitwise: Efficient Generative LLM Inference Using Phase
Splitting", Patel et al., ISCA 2024), under the Creative Commons Attribution 4.0 licence: see
traces_data/README.md beside this module for the attribution and the changes (none). The MELL paper
evaluates on "the traces from multiple LLM inference services in Azure" (§VIII-A); these are they.

Mooncake's conversation trace (FAST'25 release, "Mooncake: Trading More Storage for Less Computation",
Qin et al., USENIX FAST 2025; Apache License 2.0) is the one shipped trace with prompt block hashes
(`hash_ids`), which the simulator's prefix cache model matches: 12,031 requests sampled from one hour
of Kimi's online conversation requests. It is shipped gzip-compressed (3.0 MB to 0.8 MB); the
decompressed bytes are the release's, see traces_data/README.md.

`$KVFLEET_TRACES` names another folder holding the Azure files under the same names, as before; it
does not apply to the Mooncake trace, which is always read from the shipped copy.
"""

from __future__ import annotations

import hashlib
import os
from importlib import resources
from pathlib import Path

CONV = "AzureLLMInferenceTrace_conv.csv"
CODE = "AzureLLMInferenceTrace_code.csv"
MOONCAKE_CONV = "mooncake_conversation_trace.jsonl.gz"
# The bytes shipped; a test checks them, so an edited or truncated copy cannot pass for the dataset.
SHA256 = {
    CONV: "2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8",
    CODE: "54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6",
    # Of the .gz as shipped (`gzip -9 -n`: no name or time in the header, so the bytes are reproducible).
    MOONCAKE_CONV: "cbae1655f679723e13e66e016606208ac03590d5b470d82cc4306a249288ea8a",
}
AZURE_TRACES = (CONV, CODE)


def bundled_dir() -> Path:
    """The folder of the shipped copies (inside the kvfleet.sim package, checkout or wheel)."""
    return Path(str(resources.files("kvfleet.sim").joinpath("traces_data")))


def trace_dir() -> Path:
    """Where the Azure traces are read from: $KVFLEET_TRACES if set, else the shipped copies."""
    env = os.environ.get("KVFLEET_TRACES")
    return Path(env) if env else bundled_dir()


def trace_path(name: str = CONV) -> Path:
    return trace_dir() / name


def mooncake_conversation() -> Path:
    """The shipped Mooncake conversation trace (JSONL with `hash_ids`, gzip-compressed). Always the
    shipped copy: $KVFLEET_TRACES stands in for the Azure files only, and a folder set up for those
    would not hold this one."""
    return bundled_dir() / MOONCAKE_CONV


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
