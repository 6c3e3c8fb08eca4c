#!/usr/bin/env bash
# Where a batch-N decode step's time goes by shared object, sampled by perf (no instrumentation):
# libpython + libtorch_python + pybind11 glue is the Python side. Linux perf required.
#   bash scripts/glue_share.sh [BATCH] [SECONDS] [auto|python]
set -euo pipefail
BATCH=${1:-1}; SECONDS_=${2:-8}; LOOP=${3:-auto}
DATA=$(mktemp /tmp/glue_share.XXXXXX.data)
FIFO=$(mktemp -u); mkfifo "$FIFO"
.venv/bin/python scripts/decode_loop.py "$BATCH" "$SECONDS_" "$LOOP" > "$FIFO" &
exec 3<"$FIFO"
read -r _ PID <&3
perf record -q -F 999 -o "$DATA" -p "$PID" -- sleep "$((SECONDS_ - 1))" 2>/dev/null
cat <&3 >/dev/null; wait; rm -f "$FIFO"
# the engine's thread only (the process's own PID): OpenMP workers only ever run kernels
perf report -i "$DATA" --tid "$PID" --percentage relative --sort dso --stdio 2>/dev/null | grep -E '^ +[0-9]' | head -20
rm -f "$DATA"
