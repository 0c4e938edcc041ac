#!/usr/bin/env bash
# Runs every benchmark in a row; each prints one JSON object as its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results
mkdir -p "$out"
phx=${PHALANX:-.venv/bin/phalanx}
for b in worker rendezvous domains cache-disk replication; do
  echo "== $b" >&2
  "$phx" bench "$b" --json | tail -n 1 | tee "$out/$b.json"
done
