"""The Azure LLM inference traces (2023) that kvfleet ships, so that `kvfleet simulate`, `kvfleet
replay` and the demo run from a plain clone or an installed wheel, with no data beside them.

They are the conversation and coding services' request traces of the Azure Public Dataset's "Azure
LLM inference trace 2023" (published with "Splitwise: Efficient Generative LLM Inference Using Phase
Splitting", Patel et al., ISCA 2024), under the Creative Commons Attribution 4.0 licence: see
traces_data/README.md beside this module for the attribution and the changes (none). The MELL paper
evaluates on "the traces from multiple LLM inference services in Azure" (§VIII-A); these are they.

`$KVFLEET_TRACES` names another folder holding files of the same names, as before.
"""

from __future__ import annotations

import hashlib
import os
from importlib import resources
from pathlib import Path

CONV = "AzureLLMInferenceTrace_conv.csv"
CODE = "AzureLLMInferenceTrace_code.csv"
# The bytes shipped; a test checks them, so an edited or truncated copy cannot pass for the dataset.
SHA256 = {
    CONV: "2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8",
    CODE: "54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6",
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


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
