#!/usr/bin/env bash
# Third-party clients against ./scripts/serve.sh's cluster (issue #21): the
# tools people point at an inference server, run unchanged.
#   1. NVIDIA aiperf (0.13.0) `aiperf profile`: a streaming chat load run with
#      its server-metrics collection on; checks kvrelay's Prometheus metrics
#      are in its export (server_metrics_export.json).
#   2. the official `openai` client (tests/integration/coordinator/openai_client_check.py).
#   3. EleutherAI lm-eval (`--model local-chat-completions`) on a small
#      generative task defined here (capitals.jsonl + a task YAML), against
#      kvrelay and against llama-server on the same GGUF (built from the
#      llama.cpp inside the pinned llama-cpp-python sdist, when it builds).
# A benchmark, not a test (not in ctest). Everything is installed into a venv
# under $CACHE (default ~/.cache/kvrelay-bench); the hub is not reachable, so
# aiperf's tokenizer is written from the GGUF (bench/gguf_tokenizer.py).
#
#   bench/third_party_clients.sh [--port 8080] [--requests 24] [--concurrency 4]
#                                [--no-llama-server]
# Output: a summary on stdout; logs and the tools' exports under $OUT
# (default /tmp/kvrelay-third-party).
set -euo pipefail
cd "$(dirname "$0")/.."

PORT=8080 REQUESTS=24 CONCURRENCY=4 WITH_LLAMA=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --port) PORT=$2; shift 2 ;;
    --requests) REQUESTS=$2; shift 2 ;;
    --concurrency) CONCURRENCY=$2; shift 2 ;;
    --no-llama-server) WITH_LLAMA=0; shift ;;
    *) echo "third_party_clients.sh: unknown flag $1" >&2; exit 2 ;;
  esac
done
CACHE=${CACHE:-$HOME/.cache/kvrelay-bench}
OUT=${OUT:-/tmp/kvrelay-third-party}
VENV=$CACHE/venv
MODEL_FILE=models/SmolLM2-135M-Instruct.Q4_1.gguf
MODEL_NAME=SmolLM2-135M-Instruct.Q4_1  # what kvrelay-coordinator names it (the file's stem)
LLAMA_CPP_PYTHON_VERSION=0.3.36        # as tools/reference/setup_venv.sh pins
LLAMA_SERVER=$CACHE/llama-build/bin/llama-server
# The hub is unreachable. lm-eval runs with the offline switches (its
# datasets load the local JSONL); aiperf must not: in offline mode it looks a
# --tokenizer path up as a hub repo id in the cache, online it loads the path.
export HF_HUB_DISABLE_TELEMETRY=1
OFFLINE=(env HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1)
mkdir -p "$CACHE" "$OUT"
URL=http://127.0.0.1:$PORT
LLAMA_PORT=$((PORT + 1))

SERVE_PID="" LLAMA_PID="" BUILD_PID=""
cleanup() {
  for pid in $LLAMA_PID $SERVE_PID; do
    kill -TERM "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  if [[ -n "$BUILD_PID" ]]; then kill -TERM "$BUILD_PID" 2>/dev/null || true; fi
}
trap cleanup EXIT
say() { echo "[third-party] $*"; }

# wait_http URL SECONDS PID: until URL answers 200, the process dies, or time runs out.
wait_http() {
  local deadline=$((SECONDS + $2))
  while ((SECONDS < deadline)); do
    if curl -sf -o /dev/null "$1"; then return 0; fi
    if ! kill -0 "$3" 2>/dev/null; then return 1; fi
    sleep 0.5
  done
  return 1
}

# --- llama-server: a long build on 2 cores, so it starts first, in the background ---
build_llama_server() {
  [[ -x $LLAMA_SERVER ]] && return 0
  CACHE=$CACHE bench/build_llamacpp.sh native
}
if ((WITH_LLAMA)) && [[ ! -x $LLAMA_SERVER ]]; then
  say "building llama-server (llama.cpp of llama-cpp-python $LLAMA_CPP_PYTHON_VERSION) in the background"
  build_llama_server >"$OUT/llama-build.log" 2>&1 &
  BUILD_PID=$!
fi

# --- the venv ---
if ! "$VENV/bin/python" -c "import aiperf, openai, lm_eval, tokenizers, gguf" 2>/dev/null; then
  say "installing aiperf 0.13.0, openai, lm-eval, tokenizers, gguf into $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "aiperf==0.13.0" openai "lm-eval[api]==0.4.13" tokenizers gguf
fi
AIPERF_VERSION=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('aiperf'))")
LMEVAL_VERSION=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('lm-eval'))")
OPENAI_VERSION=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('openai'))")

# --- the cluster ---
if curl -sf -o /dev/null "$URL/health"; then
  echo "third_party_clients.sh: something already serves $URL; pass --port" >&2; exit 1
fi
say "starting ./scripts/serve.sh --port $PORT (installs, builds, then 1 prefill + 1 decode group of TP = 2)"
./scripts/serve.sh --port "$PORT" >"$OUT/serve.log" 2>&1 &
SERVE_PID=$!
if ! wait_http "$URL/health" 1800 "$SERVE_PID"; then
  tail -30 "$OUT/serve.log" >&2; echo "third_party_clients.sh: the cluster did not come up" >&2; exit 1
fi
say "cluster healthy: $(curl -s "$URL/health")"

# --- 1. the official openai client ---
say "openai $OPENAI_VERSION: tests/integration/coordinator/openai_client_check.py"
"$VENV/bin/python" tests/integration/coordinator/openai_client_check.py "$URL/v1" "$MODEL_NAME" \
  >"$OUT/openai.json"
"$VENV/bin/python" - "$OUT/openai.json" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))
print("openai: chat %r (%s, %d+%d tokens); stream equal: %s; completion %r; models %s; 404 %s; 400 %s; n=2 %s"
      % (j["chat"]["content"], j["chat"]["finish_reason"], j["chat"]["prompt_tokens"],
         j["chat"]["completion_tokens"], j["chat_stream"]["content"] == j["chat"]["content"],
         j["completion"]["text"], j["models"], j["unknown_model"]["status"],
         j["bad_max_tokens"]["status"], j["n_choices"]["indexes"]))
EOF

# --- 2. aiperf, with the server's /metrics scraped ---
say "aiperf $AIPERF_VERSION: tokenizer from the GGUF, then aiperf profile"
"$VENV/bin/python" bench/gguf_tokenizer.py "$MODEL_FILE" "$OUT/tokenizer"
"$VENV/bin/python" - "$OUT/tokenizer" "$URL" "$MODEL_NAME" <<'EOF'
# The written tokenizer must count a prompt as the server does.
import json, sys, urllib.request
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1] + "/tokenizer.json")
text = "The capital of France is Paris; 12345 apples cost $6.78 (approx.)."
req = urllib.request.Request(sys.argv[2] + "/v1/completions", method="POST",
                             headers={"Content-Type": "application/json"},
                             data=json.dumps({"model": sys.argv[3], "prompt": text, "max_tokens": 1}).encode())
server = json.load(urllib.request.urlopen(req, timeout=120))["usage"]["prompt_tokens"]
local = len(tok.encode(text).ids)
print("tokenizer check: %d tokens locally, %d by the server" % (local, server))
sys.exit(0 if local == server else 1)
EOF
rm -rf "$OUT/aiperf"
"$VENV/bin/aiperf" profile --model "$MODEL_NAME" --url "$URL" --endpoint-type chat --streaming \
  --tokenizer "$OUT/tokenizer" --synthetic-input-tokens-mean 128 --synthetic-input-tokens-stddev 0 \
  --output-tokens-mean 32 --output-tokens-stddev 0 --extra-inputs ignore_eos:true \
  --request-count "$REQUESTS" --concurrency "$CONCURRENCY" --random-seed 7 \
  --server-metrics-formats json csv --ui-type none --output-artifact-dir "$OUT/aiperf" \
  >"$OUT/aiperf.log" 2>&1 || { tail -40 "$OUT/aiperf.log" >&2; echo "aiperf failed" >&2; exit 1; }
"$VENV/bin/python" - "$OUT/aiperf" <<'EOF'
import glob, json, sys
d = sys.argv[1]
agg = json.load(open(glob.glob(d + "/**/profile_export_aiperf.json", recursive=True)[0]))
def stat(name, key="avg"):
    m = agg.get(name) or agg.get("records", {}).get(name) or {}
    return m.get(key), m.get("unit", "")
print("aiperf: %d requests" % (stat("request_count", "avg")[0] or 0))
for name in ("time_to_first_token", "inter_token_latency", "request_latency",
             "output_token_throughput", "request_throughput", "output_sequence_length",
             "input_sequence_length"):
    avg, unit = stat(name)
    p50, _ = stat(name, "p50")
    if avg is not None:
        print("  %-26s avg %10.2f  p50 %10.2f  %s" % (name, avg, p50 if p50 is not None else float("nan"), unit))
files = glob.glob(d + "/**/server_metrics_export.json", recursive=True)
if not files:
    sys.exit("aiperf wrote no server_metrics_export.json: server-metrics collection was off")
sm = json.load(open(files[0]))
names = sorted(n for n in sm.get("metrics", {}) if n.startswith("kvrelay_"))
fetches = sum(e.get("total_fetches", 0) for e in sm["summary"]["endpoint_info"].values())
print("aiperf server metrics (%s): %d kvrelay metrics, %d scrapes of %s"
      % (files[0].split("/")[-1], len(names), fetches, ", ".join(sm["summary"]["endpoint_info"])))
for n in names:
    m = sm["metrics"][n]
    for series in m["series"]:
        st = series["stats"]
        labels = ",".join("%s=%s" % kv for kv in sorted(series["labels"].items()) if kv[0] != "model_name")
        if m["type"] == "counter":
            value = "total %g, rate %.2f/s" % (st.get("total", 0), st.get("rate", 0))
        elif m["type"] == "histogram":
            value = "count %d, avg %.4g, p50 %.4g" % (st.get("count", 0), st.get("avg") or 0,
                                                      st.get("p50_estimate") or 0)
        else:
            value = "avg %.4g, max %.4g" % (st.get("avg", 0), st.get("max", 0))
        print("  %-44s %-9s %-22s %s" % (n, m["type"], labels, value))
if not names:
    sys.exit("no kvrelay_ metric in aiperf's server-metrics export")
EOF

# --- 3. lm-eval on a local generative task, kvrelay then llama-server ---
TASKS=$OUT/lm_eval_tasks
mkdir -p "$TASKS"
python3 - "$TASKS" <<'EOF'
import json, sys
d = sys.argv[1]
pairs = [("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
         ("Portugal", "Lisbon"), ("Japan", "Tokyo"), ("China", "Beijing"), ("Russia", "Moscow"),
         ("Egypt", "Cairo"), ("Greece", "Athens"), ("Austria", "Vienna"), ("Norway", "Oslo"),
         ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Denmark", "Copenhagen"),
         ("Poland", "Warsaw"), ("Ireland", "Dublin"), ("Hungary", "Budapest"), ("Canada", "Ottawa"),
         ("Australia", "Canberra"), ("Argentina", "Buenos Aires"), ("Peru", "Lima"),
         ("Kenya", "Nairobi"), ("Thailand", "Bangkok"), ("South Korea", "Seoul"),
         ("Turkey", "Ankara"), ("Iran", "Tehran"), ("Cuba", "Havana"), ("Belgium", "Brussels"),
         ("Netherlands", "Amsterdam"), ("Switzerland", "Bern"), ("Mexico", "Mexico City")]
with open(d + "/capitals.jsonl", "w") as f:
    for country, capital in pairs:
        f.write(json.dumps({"country": country, "capital": capital}) + "\n")
open(d + "/utils.py", "w").write('''
import re
def process_results(doc, results):
    answer = results[0].strip()
    want = doc["capital"].lower()
    words = re.sub(r"[^\\w ]", " ", answer.lower()).split()
    return {"contains": float(want in answer.lower()),
            "exact_match": float(" ".join(words) == want)}
''')
open(d + "/kvrelay_capitals.yaml", "w").write(f'''task: kvrelay_capitals
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d}/capitals.jsonl
test_split: test
output_type: generate_until
doc_to_text: "What is the capital of {{{{country}}}}? Answer with the name of the city only."
doc_to_target: "{{{{capital}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 24
  do_sample: false
  temperature: 0
process_results: !function utils.process_results
metric_list:
  - metric: contains
    aggregation: mean
    higher_is_better: true
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
''')
EOF
run_lm_eval() {  # run_lm_eval NAME CHAT_URL MODEL
  rm -rf "$OUT/lm_eval_$1"
  "${OFFLINE[@]}" "$VENV/bin/lm_eval" --model local-chat-completions \
    --model_args "model=$3,base_url=$2,num_concurrent=1,max_retries=1,tokenized_requests=False,tokenizer_backend=None,timeout=300" \
    --tasks kvrelay_capitals --include_path "$TASKS" --apply_chat_template \
    --output_path "$OUT/lm_eval_$1" --log_samples >"$OUT/lm_eval_$1.log" 2>&1 ||
    { tail -30 "$OUT/lm_eval_$1.log" >&2; echo "lm_eval against $1 failed" >&2; return 1; }
  "$VENV/bin/python" - "$OUT/lm_eval_$1" "$1" <<'EOF'
import glob, json, sys
f = sorted(glob.glob(sys.argv[1] + "/**/results_*.json", recursive=True))[-1]
r = json.load(open(f))["results"]["kvrelay_capitals"]
print("lm-eval kvrelay_capitals on %-12s contains %.3f (± %.3f)  exact_match %.3f  (%s)"
      % (sys.argv[2], r["contains,none"], r.get("contains_stderr,none", float("nan")),
         r["exact_match,none"], f.split("/")[-1]))
EOF
}
say "lm-eval $LMEVAL_VERSION against kvrelay"
run_lm_eval kvrelay "$URL/v1/chat/completions" "$MODEL_NAME"
say "kvrelay /metrics after all three tools:"
curl -s "$URL/metrics" | grep -E '^kvrelay_(http_requests_total|requests_finished_total|generation_tokens_total|prompt_tokens_total|refused)' || true

if ((WITH_LLAMA)); then
  if [[ -n "$BUILD_PID" ]]; then
    say "waiting for the llama-server build (log: $OUT/llama-build.log)"
    wait "$BUILD_PID" || true
    BUILD_PID=""
  fi
  if [[ -x $LLAMA_SERVER ]]; then
    # Stop the cluster first: the two servers share 2 cores.
    kill -TERM "$SERVE_PID" 2>/dev/null || true; wait "$SERVE_PID" 2>/dev/null || true; SERVE_PID=""
    "$LLAMA_SERVER" -m "$MODEL_FILE" --host 127.0.0.1 --port "$LLAMA_PORT" -t "$(nproc)" -c 4096 -np 1 \
      --alias "$MODEL_NAME" >"$OUT/llama-server.log" 2>&1 &
    LLAMA_PID=$!
    if wait_http "http://127.0.0.1:$LLAMA_PORT/health" 120 "$LLAMA_PID"; then
      say "lm-eval $LMEVAL_VERSION against llama-server ($("$LLAMA_SERVER" --version 2>&1 | grep -m1 version))"
      run_lm_eval llama-server "http://127.0.0.1:$LLAMA_PORT/v1/chat/completions" "$MODEL_NAME"
    else
      tail -20 "$OUT/llama-server.log" >&2; say "llama-server did not start; no comparison"
    fi
  else
    say "llama-server could not be built (see $OUT/llama-build.log); no comparison"
  fi
fi
say "done; logs and exports in $OUT"
