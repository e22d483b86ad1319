"""Fixtures for tests against the real local control plane (kvfleet.localcluster).

One cluster per test session (starting it costs ~10 s); each test gets a fresh namespace.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfleet.localcluster.cluster import Cluster, local_cluster


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    keep = os.environ.get("KVFLEET_KEEP_CLUSTER_DIR") == "1"
    work_dir = tmp_path_factory.mktemp("cluster") if keep else None
    # e2e/ on the node agent's path: the scripted stand-in worker image runs kvfleet_e2e.scripted_worker.
    with local_cluster(num_nodes=3, gpus_per_node=2, num_zones=2, work_dir=work_dir,
                       extra_python_path=[Path(__file__).parent]) as running:
        yield running


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    digest = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:8]
    name = f"t-{request.node.name[:40].lower().strip('_').replace('_', '-')}-{digest}"
    name = "".join(c if c.isalnum() or c == "-" else "-" for c in name)[:63].strip("-")
    cluster.kubectl("create", "namespace", name)
    cluster.wait_default_service_account(name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny local model (random weights, local tokenizer) a module's real workers serve."""
    from kvfleet.worker.model.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("models") / "tiny")
