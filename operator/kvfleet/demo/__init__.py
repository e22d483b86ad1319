"""`make demo` (`python -m kvfleet.demo`): kvfleet's whole story on one machine, on the CPU.

It lives beside the product rather than in the test harness because it is what a new user runs first;
it uses the same local cluster (kvfleet.localcluster) the e2e tests use, so what it shows is what they
check. `story.py` holds the run; `--hold` keeps the cluster up for poking at it with kubectl.
"""
