#!/usr/bin/env bash
# The two model examples decoding through a CUDA specstated, from a bundle made
# by tools/gpu/bundle.sh, on a machine with an NVIDIA GPU, torch and
# transformers (the output goes into docs/integration.md, "Results"):
#   tools/gpu/examples.sh BUNDLE OUTDIR [qwen3|kda|all]
# - qwen3: transformers' own Qwen3-Next modules (tiny, random, fp32) with
#   their GDN layers' state in SpecState's pools, against transformers'
#   generate, in EAGER, DEFERRED and FAST (QWEN3_FLAGS adds flags, e.g.
#   --cache_mode=none,align; QWEN3_PROMPTS and QWEN3_TOKENS size it);
# - kda: client/python/examples/kda_decode.py (a KDA model in torch) against
#   its own one-token-at-a-time reference, in the same three modes (KDA_MODES,
#   KDA_TOKENS and KDA_TIMEOUT change that).
# MPS=1 runs both under a private MPS daemon (as production would).
# Exits non-zero when a check failed.
set -uo pipefail
bundle=$(cd "$1" && pwd)
out=$2
what=${3:-all}
mkdir -p "$out"
summary="$out/examples_summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }
status=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | sed 's/^/gpu: /' | tee -a "$summary"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' \
  2>&1 | tee -a "$summary"
if [ "${MPS:-0}" = 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/ss-mps CUDA_MPS_LOG_DIRECTORY=/tmp/ss-mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d && note "MPS: daemon started" || { note "MPS: cannot start"; exit 1; }
  trap 'echo quit | nvidia-cuda-mps-control' EXIT
fi
# The Python processes keep their own libraries; the launcher gives
# specstated the bundled ones.
py() {  # TIMEOUT SCRIPT ARGS...
  local limit=$1; shift
  (unset LD_LIBRARY_PATH; PYTHONPATH="$bundle/python" PYTHONUNBUFFERED=1 \
    CUDA_MODULE_LOADING=EAGER timeout "$limit" python3 "$@")
}

if [ "$what" = all ] || [ "$what" = qwen3 ]; then
  # shellcheck disable=SC2086
  py "${QWEN3_TIMEOUT:-420}" "$bundle/python/examples/qwen3_next_decode.py" \
    --start_server="$bundle/specstated" --device=cuda --commit_mode=eager,deferred,fast \
    --prompts="${QWEN3_PROMPTS:-8}" --new_tokens="${QWEN3_TOKENS:-512}" --check ${QWEN3_FLAGS:-} \
    > "$out/qwen3_next_decode.log" 2>&1
  rc=$?
  note "qwen3_next_decode --check: exit $rc"
  grep -E -i '^(pass|==|tokens|accept|memory|spec|generate|throughput|FAIL|PASS|near)' \
    "$out/qwen3_next_decode.log" | head -60 | tee -a "$summary"
  [ $rc -eq 0 ] || status=1
fi

if [ "$what" = all ] || [ "$what" = kda ]; then
  for mode in ${KDA_MODES:-eager deferred fast}; do
    sock=$(mktemp -d /tmp/ssXXXXXX)/s.sock
    "$bundle/specstated" --backend=cuda --listen="unix://$sock" --layers=4 --heads=4 --head_dim=128 \
      --conv_dim=1536 --num_spec=3 --blocks=64 --max_rows=16 --activation_dtype=fp32 \
      --state_dtype=fp32 --commit_mode=$mode > "$out/kda_decode_${mode}_server.log" 2>&1 &
    server=$!
    for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
    py "${KDA_TIMEOUT:-240}" "$bundle/python/examples/kda_decode.py" --server="unix://$sock" --requests=8 \
      --tokens="${KDA_TOKENS:-512}" --check > "$out/kda_decode_$mode.log" 2>&1
    rc=$?
    note "kda_decode --check ($mode): exit $rc"
    tail -n 12 "$out/kda_decode_$mode.log" | tee -a "$summary"
    [ $rc -eq 0 ] || status=1
    kill $server; wait $server 2>/dev/null
  done
fi
exit $status
