"""A real Kubernetes cluster on one machine, without Docker: what `make demo` and the e2e tests run on.

- `build-controlplane.sh` builds etcd and the Kubernetes control plane from their Go modules (pinned
  in `versions.env`) into a cache, once per machine;
- `controlplane.py` makes the PKI and starts etcd, kube-apiserver, kube-scheduler and
  kube-controller-manager on loopback;
- `nodeagent.py` is a "process kubelet": it plays nodes with `nvidia.com/gpu` capacity (`nodes.py`)
  and runs the pods bound to them whose image `images.yaml` names (`images.py`) as local processes,
  with their environment and service-account token (`podenv.py`), probes (`probes.py`) and status
  (its records of them: `records.py`), so scheduling, pending pods, owner references and garbage
  collection are Kubernetes' own;
- `cluster.py` puts the three together (`local_cluster()`), applies kvfleet's CRDs, and starts the
  operator as a local process.

It runs from a checkout (it reads crds/ and keeps its cache in .cache/): the wheel and the images leave it out.
Nothing in the product imports it (an import-linter contract).
"""
