#!/usr/bin/env bash
# The figures of "Serving: pagedllm serve under load" (docs/benchmarks.md) in one go.
# Starts `pagedllm serve --dtype bfloat16` (engine defaults otherwise) on a free loopback port,
# measures its CPU time while idle over IDLE seconds (/proc/<pid>/stat utime + stime), then, for
# ROUNDS rounds and each concurrency C, runs one workload (max(C, 4) prompts of INPUT words, OUTPUT
# tokens each, ignore_eos, greedy) twice, alternating:
#   A: `pagedllm bench serve-offline --max-concurrency C` (LLM.generate in-process, max_num_seqs C)
#   B: `pagedllm bench serve --max-concurrency C` against the server (the load generator's and the
#      server's CPU time measured apart)
#   C: with PEER=1 (or PEER=vllm), the same `pagedllm bench serve` against vLLM's CPU server
#      (scripts/peer_vllm.sh, after `make peers`; bf16, both cores; VLLM_DTYPE=float32 for float32),
#      or with PEER=llama.cpp against llama.cpp's (scripts/peer_llamacpp.sh: it has no ignore_eos, so
#      its requests carry logit_bias -100 on the EOS tokens 0 and 2 instead), started next to ours and
#      idle while the others run
# Each (round, C) pair gets its own seed, so the server's prefix cache never holds a prompt twice.
# Prints medians per C: output tok/s offline and served, the server's overhead, latencies, CPU,
# and with PEER the peer's served tok/s and the ratio ours / the peer's.
# Usage: bash scripts/serve_bench.sh [ROUNDS] ["1 8 32 64"] [IDLE_SECONDS]
#   env: INPUT (128), OUTPUT (128), SERVE_BENCH_DIR (where the JSON reports go; default a temp dir),
#   PEER (0; 1 or vllm adds vLLM, llama.cpp adds llama.cpp), VLLM_DTYPE (vLLM's --dtype; default bfloat16);
#   OpenMP variables (OMP_WAIT_POLICY=passive, ...) reach the server and the offline runs alike.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-3}"
concurrencies="${2:-1 8 32 64}"
idle="${3:-20}"
input="${INPUT:-128}"
output="${OUTPUT:-128}"
py="$PWD/.venv/bin/python"
work="${SERVE_BENCH_DIR:-$(mktemp -d)}"
mkdir -p "$work"
wait_healthy() {  # PORT SECONDS MESSAGE [PATH]: until GET PATH (default /health) answers 200
  "$py" - "$@" <<'EOF'
import sys, time, httpx
port, seconds, message = sys.argv[1], float(sys.argv[2]), sys.argv[3]
path = sys.argv[4] if len(sys.argv) > 4 else "/health"
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    try:
        if httpx.get(f"http://127.0.0.1:{port}{path}", timeout=1).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
sys.exit(message)
EOF
}
num_prompts() { echo $(( $1 < 4 ? 4 : $1 )); }  # one wave of C requests; 4 one after the other for C = 1

port=$("$py" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
"$py" -m pagedllm serve --dtype bfloat16 --port "$port" > "$work/server.log" 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null || true' EXIT
wait_healthy "$port" 300 "the server did not start"
echo "server pid $pid at port $port; reports in $work"
peer_port=""
peer_args=()
case "${PEER:-0}" in
  1|vllm) peer_name=vLLM; peer_cmd=(bash scripts/peer_vllm.sh); peer_path=/health
          [ -n "${VLLM_DTYPE:-}" ] && peer_extra=(--dtype "$VLLM_DTYPE") ;;
  llama.cpp) peer_name=llama.cpp; peer_cmd=(bash scripts/peer_llamacpp.sh); peer_path=/v1/models
             peer_args=(--logit-bias '{"0": -100, "2": -100}') ;;
  0) ;;
  *) echo "PEER must be 0, 1/vllm or llama.cpp, got $PEER" >&2; exit 2 ;;
esac
if [ "${PEER:-0}" != 0 ]; then
  peer_port=$("$py" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  setsid "${peer_cmd[@]}" "$peer_port" ${peer_extra[@]+"${peer_extra[@]}"} > "$work/peer.log" 2>&1 &
  peer_pid=$!
  trap 'kill "$pid" 2>/dev/null; kill -- -"$peer_pid" 2>/dev/null; wait 2>/dev/null || true' EXIT
  wait_healthy "$peer_port" 600 "$peer_name's server did not start (see $work/peer.log)" "$peer_path"
  echo "$peer_name's server at port $peer_port (pid $peer_pid)"
fi
sleep 5
"$py" - "$pid" "$idle" "$work/idle.json" <<'EOF'
import json, sys, time
from pagedllm.machine import machine_info, process_cpu_seconds
pid, seconds = int(sys.argv[1]), float(sys.argv[2])
t, c = time.perf_counter(), process_cpu_seconds(pid)
time.sleep(seconds)
wall, cpu = time.perf_counter() - t, process_cpu_seconds(pid) - c
report = {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "percent_of_one_core": round(100 * cpu / wall, 3),
          "machine": machine_info()}
json.dump(report, open(sys.argv[3], "w"), indent=2)
print(f"idle server: {cpu:.3f} s of CPU in {wall:.1f} s = {100 * cpu / wall:.2f}% of one core")
EOF

for round in $(seq "$rounds"); do
  for c in $concurrencies; do
    n=$(num_prompts "$c")
    common=(--num-prompts "$n" --input-len "$input" --output-len "$output" --max-concurrency "$c"
            --seed $(( 1000 * round + c )) --no-progress)
    "$py" -m pagedllm.cli bench serve-offline "${common[@]}" --json "$work/A.$c.$round.json" > "$work/A.$c.$round.log" 2>&1
    "$py" -m pagedllm.cli bench serve "${common[@]}" --base-url "http://127.0.0.1:$port/v1" --server-pid "$pid" \
      --json "$work/B.$c.$round.json" > "$work/B.$c.$round.log" 2>&1
    peer=""
    if [ -n "$peer_port" ]; then
      "$py" -m pagedllm.cli bench serve "${common[@]}" --base-url "http://127.0.0.1:$peer_port/v1" \
        ${peer_args[@]+"${peer_args[@]}"} --json "$work/C.$c.$round.json" > "$work/C.$c.$round.log" 2>&1
      peer="| C $(grep 'Output token throughput' "$work/C.$c.$round.log" | awk '{print $NF}') tok/s"
    fi
    echo "round $round/$rounds, $c streams ($n prompts): A $(tail -c 60 "$work/A.$c.$round.log" | tr -d '\n')" \
         "| B $(grep 'Output token throughput' "$work/B.$c.$round.log" | awk '{print $NF}') tok/s $peer"
  done
done

PEER_NAME="${peer_name:-}" "$py" - "$work" $concurrencies <<'EOF'
import json, os, statistics, sys
from pathlib import Path

work, concurrencies = Path(sys.argv[1]), sys.argv[2:]
med = statistics.median
load = lambda side, c: [json.loads(p.read_text()) for p in sorted(work.glob(f"{side}.{c}.*.json"))]
print(f"{'streams':>7} {'offline tok/s':>22} {'served tok/s':>22} {'overhead':>9} {'TTFT p50':>9} {'TPOT p50':>9} "
      f"{'ITL p99':>8} {'client cores':>12} {'server cores':>12} {'offline cores':>13}")
first = json.loads(next(work.glob("B.*.json")).read_text())["machine"]
print(f"{first['cpu']}, {first['cores']} cores, {' '.join(first['flags']) or 'no avx512/amx'}; "
      f"OpenMP env {first['threading_env'] or 'default'}")
rows = {}
for c in concurrencies:
    a, b = load("A", c), load("B", c)
    assert all(r["failed"] == 0 and r["total_output_tokens"] == r["requested_output_tokens"] for r in a + b)
    ta, tb = [r["output_throughput"] for r in a], [r["output_throughput"] for r in b]
    # overhead per round (A and B ran back to back), then the median of those
    over = med(1 - y / x for x, y in zip(ta, tb, strict=True))
    row = {"offline_tok_s": med(ta), "offline_runs": ta, "served_tok_s": med(tb), "served_runs": tb,
           "overhead": over, "ttft_p50_ms": med(r["ttft_ms"]["p50"] for r in b),
           "tpot_p50_ms": med(r["tpot_ms"]["p50"] for r in b), "itl_p99_ms": med(r["itl_ms"]["p99"] for r in b),
           "e2e_p50_ms": med(r["e2e_ms"]["p50"] for r in b),
           "client_cores": med(r["client_cpu"]["cores_busy"] for r in b),
           "server_cores": med(r["server_cpu"]["cores_busy"] for r in b),
           "offline_cores": med(r["process_cpu"]["cores_busy"] for r in a),
           "load_average_1m": [r["machine"]["load_average_1m"] for r in a + b],
           # the hypervisor's steal from the machine during each run (other tenants): A runs, B runs
           "steal_s": [[r["process_cpu"].get("machine_steal_s") for r in a],
                       [r["client_cpu"].get("machine_steal_s") for r in b]]}
    rows[c] = row
    print(f"{c:>7} {row['offline_tok_s']:>8.1f} {str([round(x, 1) for x in ta]):>13} "
          f"{row['served_tok_s']:>8.1f} {str([round(x, 1) for x in tb]):>13} {100 * over:>8.1f}% "
          f"{row['ttft_p50_ms']:>9.0f} {row['tpot_p50_ms']:>9.1f} {row['itl_p99_ms']:>8.0f} "
          f"{row['client_cores']:>12.3f} {row['server_cores']:>12.3f} {row['offline_cores']:>13.3f}  "
          f"steal s {row['steal_s']}")
    peer = load("C", c)
    if peer:
        # a server without usage in its stream (llama.cpp's) is counted by chunks: one chunk may hold
        # two tokens (bytes of one character held back), so allow 1% there
        assert all(r["failed"] == 0 and abs(r["total_output_tokens"] - r["requested_output_tokens"])
                   <= 0.01 * r["requested_output_tokens"] for r in peer)
        tc = [r["output_throughput"] for r in peer]
        name = os.environ.get("PEER_NAME", "vLLM")
        key = name.lower().replace(".", "")  # vllm, llamacpp
        row.update({"peer": name, f"{key}_tok_s": med(tc), f"{key}_runs": tc,
                    f"ratio_to_{key}": med(y / z for y, z in zip(tb, tc, strict=True)),
                    f"{key}_ttft_p50_ms": med(r["ttft_ms"]["p50"] for r in peer),
                    f"{key}_tpot_p50_ms": med(r["tpot_ms"]["p50"] for r in peer)})
        print(f"{'':>7} {name} served {row[f'{key}_tok_s']:.1f} tok/s {[round(x, 1) for x in tc]}, TTFT p50 "
              f"{row[f'{key}_ttft_p50_ms']:.0f} ms, TPOT p50 {row[f'{key}_tpot_p50_ms']:.1f} ms; "
              f"pagedllm / {name} {row[f'ratio_to_{key}']:.2f}")
json.dump(rows, open(work / "summary.json", "w"), indent=2)
EOF
