#!/usr/bin/env bash
# `make test`: the suite on WORKERS pytest-xdist workers (0: one process), most of its time being
# servers waiting on sockets and the sim device's modelled steps; then the tests marked serial,
# which read times on the host, alone. pytest exits 5 when it ran nothing: that fails only if
# neither phase ran a test.
# usage: tests/suite.sh PYTHON WORKERS [pytest arguments...]
set -u
py=$1 workers=$2
shift 2
"$py" -m pytest -n "$workers" -m "not serial" "$@"
a=$?
"$py" -m pytest -m serial "$@"
b=$?
if [ "$a" -eq 5 ] && [ "$b" -eq 5 ]; then exit 5; fi
for rc in "$a" "$b"; do
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then exit "$rc"; fi
done
exit 0
