#!/usr/bin/env bash
# Compare this checkout (B) with an earlier commit (A) on the engine benchmarks, in alternating
# runs on one machine (A, B, A, B, ...: the machine's speed drifts, so only ratios from the same
# run mean anything), and print the median tok/s of each side and the ratio B / A.
# Usage: bash scripts/ab_bench.sh REV [ROUNDS] [BENCH...]
#   bash scripts/ab_bench.sh 28555ce 3 "step --batch 64" "step --batch 1" "throughput --skip-hf"
# A runs from a git worktree of REV (in $TMPDIR) with this checkout's .venv and PYTHONPATH=src;
# an A older than the installed C++ build compiles its kernels into the cache on its first run.
set -euo pipefail
cd "$(dirname "$0")/.."
rev="${1:?usage: ab_bench.sh REV [ROUNDS] [BENCH...]}"
rounds="${2:-3}"
shift $(( $# < 2 ? $# : 2 ))
benches=("$@")
[ ${#benches[@]} -gt 0 ] || benches=("step --batch 64" "step --batch 1" "throughput --skip-hf")
py="$PWD/.venv/bin/python"
work="$(mktemp -d)"
git worktree add -q --detach "$work/a" "$rev"
trap 'git worktree remove --force "$work/a"' EXIT
for round in $(seq "$rounds"); do
  for i in "${!benches[@]}"; do
    for side in A B; do
      dir=$PWD; pp=
      [ "$side" = A ] && { dir="$work/a"; pp=src; }
      # shellcheck disable=SC2086  # the bench arguments are meant to split
      (cd "$dir" && PYTHONPATH=$pp "$py" -m pagedllm.cli bench ${benches[$i]} --json "$work/$side.$i.$round.json" \
        > "$work/$side.$i.$round.log" 2>&1) || { echo "$side: bench ${benches[$i]} failed:"; tail "$work/$side.$i.$round.log"; exit 1; }
      echo "round $round/$rounds: $side bench ${benches[$i]} done"
    done
  done
done
"$py" - "$work" "${benches[@]}" <<'EOF'
import json, statistics, sys
from pathlib import Path

work, benches = Path(sys.argv[1]), sys.argv[2:]

def tok_s(path: Path) -> float:
    report = json.loads(path.read_text())
    if "tokens_per_s" in report:
        return report["tokens_per_s"]
    return next(r["tokens_per_s"] for r in report["results"] if r["system"] == "pagedllm")

print(f"{'bench':<28}{'A tok/s (runs)':<30}{'B tok/s (runs)':<30}{'B / A':>7}")
for i, bench in enumerate(benches):
    a = [tok_s(p) for p in sorted(work.glob(f"A.{i}.*.json"))]
    b = [tok_s(p) for p in sorted(work.glob(f"B.{i}.*.json"))]
    ratio = statistics.median(b) / statistics.median(a)
    print(f"{bench:<28}{statistics.median(a):<8.1f}{str(a):<22}{statistics.median(b):<8.1f}{str(b):<22}{ratio:>7.3f}")
EOF
