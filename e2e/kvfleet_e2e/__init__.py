"""What only the e2e tests need beside the local cluster (kvfleet.localcluster): the scripted stand-in
worker, pools of it, and the chart's RBAC call list with a helm driver."""
