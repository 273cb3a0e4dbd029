#!/usr/bin/env bash
# `make test`: the suite on WORKERS pytest-xdist workers (0: one process), most of its time being
# servers waiting on sockets and the sim device's modelled steps. The tests marked serial read
# shares and latencies off client-side times, which other tests' load skews: `make
# fairness-http` runs them alone, on a quiet machine. The 15 slowest tests are listed at the end.
# Tests run in file order (pytest-randomly is off in pyproject's addopts; `make test-random`
# turns it on). pytest exits 5 when it ran nothing, which fails here.
# usage: tests/suite.sh PYTHON WORKERS [pytest arguments...]
set -u
py=$1 workers=$2
shift 2
exec "$py" -m pytest -n "$workers" -m "not serial" --durations=15 "$@"
