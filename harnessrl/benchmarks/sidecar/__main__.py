"""`python -m harnessrl.benchmarks.sidecar`."""

from harnessrl.benchmarks.sidecar import main

main()
