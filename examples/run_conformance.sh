#!/usr/bin/env bash
# Run pp1-conformance against a worker. With no argument, start a local
# pp1-worker on a free port first; with HOST:PORT, test that endpoint.
#   examples/run_conformance.sh                    # a fresh local worker
#   examples/run_conformance.sh 10.0.0.5:7070      # any worker (add --vocab etc.)
set -euo pipefail
python="${PYTHON:-python3}"
if [ $# -ge 1 ]; then
  exec pp1-conformance --worker "$@"
fi
log=$(mktemp)
# Each case opens a new connection and some hang up mid-draw on purpose: a
# keyless worker would pace this address's new lineages (docs/protocol.md §4.4).
"$python" -m pp1wire.apps.worker --port 0 --vocab 4096 --handshake-timeout 2 \
  --lineage-rate 1000 --lineage-burst 65535 --log-level warning >"$log" &
worker=$!
trap 'kill "$worker" 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 100); do
  grep -q listening "$log" && break
  sleep 0.1
done
address=$(awk '{print $NF}' "$log")
"$python" -m pp1wire.testing.conformance --worker "$address" --vocab 4096 --handshake-wait 4 --junit conformance.xml
