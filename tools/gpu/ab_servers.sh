#!/usr/bin/env bash
# Two specstated builds against each other under MPS, alternately, ROUNDS (2)
# times each, on the Kimi-Linear layout: service_bench's echo comparison
# (ASYNC Verify against a bare Ping) and its N=1 decode step, per run.
#   tools/gpu/ab_servers.sh BUNDLE SPECSTATED_A SPECSTATED_B
# (BUNDLE from tools/gpu/bundle.sh supplies service_bench and the libraries;
# A and B are specstated binaries, e.g. bundle/bin/specstated and an older
# build copied beside it.)
set -u
bundle=$(cd "$1" && pwd); a=$2; b=$3; rounds=${ROUNDS:-2}
export LD_LIBRARY_PATH="$bundle/lib"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/ab-mps CUDA_MPS_LOG_DIRECTORY=/tmp/ab-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d || { echo "MPS: cannot start the daemon"; exit 1; }
big="--layers=20 --heads=32 --head_dim=128 --conv_dim=12288 --num_spec=3 --blocks=300 --max_rows=256"
for round in $(seq "$rounds"); do
  for which in A B; do
    bin=$a; [ $which = B ] && bin=$b
    rm -f /tmp/ab.sock
    "$bin" --backend=cuda --listen=unix:///tmp/ab.sock $big > "/tmp/ab_$which.log" 2>&1 &
    pid=$!
    for _ in $(seq 200); do [ -S /tmp/ab.sock ] && break; sleep 0.1; done
    timeout 60 "$bundle/bin/service_bench" --server=unix:///tmp/ab.sock --iters=200 --steps=20 \
      > "/tmp/ab_${which}_${round}.md" 2> /tmp/ab.err
    echo "== round $round $which ($bin, exit $?)"
    grep -E "^\| (tensors sent|bound inputs) \||^\| decode step \| 1 \|" "/tmp/ab_${which}_${round}.md"
    kill $pid; wait $pid 2>/dev/null
  done
done
echo quit | nvidia-cuda-mps-control
