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
# serve runs twice: on the embedded model, and on the engine benchmark's larger size,
# where a miss's compute outweighs the server's fixed part of a request
large=$(mktemp -d /tmp/phx-bench-large-XXXXXX)
trap 'rm -rf "$large"' EXIT
"$phx" model init "$large/m8x512" --layers 8 --hidden 512 >/dev/null
declare -A args=([worker]="--ranks 2" [rendezvous]="--ranks 2" [domains]="--ranks 2 --cycles 1000"
                 [cache-disk]="--reps 5" [replication]="--peers 2" [engine]=""
                 [serve]="" [serve-8x512]="--model $large/m8x512" [llamacpp]=""
                 [multihost]="--repeats 3" [soak]="" [structured]="")
for name in worker rendezvous domains cache-disk replication engine serve serve-8x512 llamacpp \
    multihost soak structured; do
  b=${name%-8x512}
  # multihost makes network namespaces: root and iproute2's ip only
  if [[ $b == multihost ]] && { [[ $(id -u) != 0 ]] || ! command -v ip >/dev/null; }; then
    echo "== $b skipped: network namespaces need root and iproute2's ip" >&2
    continue
  fi
  # llamacpp needs llama-server built first (bench/setup_llamacpp.sh, ~10 min)
  if [[ $b == llamacpp ]] && ! "${phx%phalanx}python" -c \
      'import sys; from phalanx_bench.llamacpp_build import server_path; sys.exit(not server_path().exists())'; then
    echo "== $b skipped: llama-server is not built (bench/setup_llamacpp.sh)" >&2
    continue
  fi
  echo "== $name ${args[$name]}" >&2
  # shellcheck disable=SC2086  (the arguments are words)
  "$phx" bench "$b" ${args[$name]} --json | tail -n 1 | tee "$out/$name.json" >>"$out/$name.runs.jsonl"
done
