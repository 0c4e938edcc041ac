#!/usr/bin/env bash
# Runs every benchmark in a row, one at a time; each prints one JSON object as its last
# line, kept in bench/results/NAME.json (and every run's in NAME.runs.jsonl).
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results
mkdir -p "$out"
phx=${PHALANX:-.venv/bin/phalanx}
if pgrep -af "phalanx bench" >/dev/null; then
  echo "another benchmark is running (pgrep -af 'phalanx bench'): one at a time" >&2
  exit 1
fi
declare -A args=([worker]="--ranks 2" [rendezvous]="--ranks 2" [domains]="--ranks 2 --cycles 1000"
                 [cache-disk]="--reps 5" [replication]="--peers 2" [multihost]="--repeats 3")
for b in worker rendezvous domains cache-disk replication multihost; do
  # multihost makes network namespaces: root and iproute2's ip only
  if [[ $b == multihost ]] && { [[ $(id -u) != 0 ]] || ! command -v ip >/dev/null; }; then
    echo "== $b skipped: network namespaces need root and iproute2's ip" >&2
    continue
  fi
  echo "== $b ${args[$b]}" >&2
  # shellcheck disable=SC2086  (the arguments are words)
  "$phx" bench "$b" ${args[$b]} --json | tail -n 1 | tee "$out/$b.json" >>"$out/$b.runs.jsonl"
done
