"""The e2e harness: a real local Kubernetes control plane, a process-running node agent, the demo."""
