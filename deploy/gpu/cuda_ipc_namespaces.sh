#!/usr/bin/env bash
# Which namespaces, users and MPS set-ups CUDA IPC works across, on a GPU
# machine, as root (it makes namespaces with unshare and switches users with
# setpriv): deploy/README.md cites its output.
#
#   deploy/gpu/cuda_ipc_namespaces.sh [PYTHON]
#
# Each case runs cuda_ipc_probe.py's exporter (cuMemAlloc + cuIpcGetMemHandle)
# and importer (cuIpcOpenMemHandle, read, write) with a wrapper around each:
# a namespace of its own is what a separate container has (mount, PID, IPC,
# network), and Kubernetes' shareProcessNamespace or docker --pid=host takes
# away the PID one. The MPS cases run a control daemon with a private pipe
# directory and stop it again; nothing else on the machine is changed.
set -uo pipefail
PY=${1:-python3}
P=${PROBE:-$(cd "$(dirname "$0")" && pwd)/cuda_ipc_probe.py}
D=$(mktemp -d /tmp/ipcns.XXXXXX)
chmod 1777 "$D"
export MPS_PIPE=$D/mps-pipe MPS_LOG=$D/mps-log

# Wrappers. Each new mount namespace also gets a private /dev/shm, as a
# container does.
MNT="unshare --mount --propagation private sh -c 'mount -t tmpfs shm /dev/shm && exec \"\$@\"' sh"
PID="unshare --pid --fork --mount-proc"
PIDONLY="unshare --pid --fork"
IPC="unshare --ipc"
NET="unshare --net"
USERNS="unshare --user --map-root-user"
U1000="setpriv --reuid=1000 --regid=1000 --clear-groups"
U1001="setpriv --reuid=1001 --regid=1001 --clear-groups"
NOCAPS="setpriv --inh-caps=-all --bounding-set=-all"
MPSENV="env CUDA_MPS_PIPE_DIRECTORY=$MPS_PIPE CUDA_MPS_LOG_DIRECTORY=$MPS_LOG"

run() {  # NAME EXPORTER-WRAPPER IMPORTER-WRAPPER
  local name=$1 ew=$2 iw=$3 f=$D/$1 ep er ir
  ( eval "timeout 60 $ew $PY $P export $f" ) >"$f.e" 2>&1 &
  ep=$!
  for _ in $(seq 400); do [ -e "$f" ] && break; kill -0 $ep 2>/dev/null || break; sleep 0.05; done
  if [ -e "$f" ]; then
    ( eval "timeout 60 $iw $PY $P import $f" ) >"$f.i" 2>&1; ir=$?
  else
    echo "(no handle)" >"$f.i"; ir=9
  fi
  wait $ep; er=$?
  printf '%-34s import rc=%s export rc=%s | %s | %s\n' "$name" "$ir" "$er" \
    "$(tail -n1 "$f.i")" "$(tail -n1 "$f.e")"
}

mps_start() {  # WRAPPER (daemon in the foreground, backgrounded here)
  mkdir -p "$MPS_PIPE" "$MPS_LOG"; chmod 0777 "$MPS_PIPE" "$MPS_LOG"
  ( eval "$1 $MPSENV nvidia-cuda-mps-control -f" ) >"$D/mps-daemon.out" 2>&1 &
  for _ in $(seq 100); do [ -p "$MPS_PIPE/control" ] && break; sleep 0.1; done
  ls -l "$MPS_PIPE" | sed 's/^/    pipe dir: /'
}
mps_stop() {
  echo quit | $MPSENV nvidia-cuda-mps-control; sleep 1
  tail -n 4 "$MPS_LOG"/control.log 2>/dev/null | sed 's/^/    control.log: /'
  rm -rf "$MPS_PIPE" "$MPS_LOG"
}

echo "== $(uname -r); driver $(nvidia-smi --query-gpu=driver_version,name,compute_mode --format=csv,noheader)"
echo "== ptrace_scope $(cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null || echo none); $(ls -l /dev/nvidia* | tr -s ' ' | cut -d' ' -f1,10 | tr '\n' ' ')"
echo "== without MPS"
run same-namespaces "" ""
run importer-mount-ns "" "$MNT"
run importer-pid-ns "" "$PID"
run exporter-pid-ns "$PID" ""
run importer-pid-ns-host-proc "" "$PIDONLY"
run both-own-pid-ns "$PID" "$PID"
run importer-ipc-ns "" "$IPC"
run importer-net-ns "" "$NET"
run importer-user-ns "" "$USERNS"
run both-uid-1000 "$U1000" "$U1000"
run uid-1000-to-uid-1001 "$U1000" "$U1001"
run importer-root-no-caps "" "$NOCAPS"
# Containers: own mount, IPC and network namespaces each (two pods, or two
# docker containers with --pid=host), then own PID namespaces as well.
run pod-shareProcessNamespace "$MNT" "$MNT"
run own-mnt-ipc-net-shared-pid "$MNT $IPC $NET" "$MNT $IPC $NET"
run own-mnt-ipc-net-pid "$MNT $IPC $NET $PID" "$MNT $IPC $NET $PID"
run own-mnt-net-pid-shared-ipc "$MNT $NET $PID" "$MNT $NET $PID"

echo "== MPS: control daemon as root, clients as root"
mps_start ""
run mps-same-namespaces "$MPSENV" "$MPSENV"
run mps-importer-mount-ns "$MPSENV" "$MPSENV $MNT"
run mps-importer-pid-ns "$MPSENV" "$MPSENV $PID"
run mps-exporter-pid-ns "$MPSENV $PID" "$MPSENV"
run mps-both-own-pid-ns "$MPSENV $PID" "$MPSENV $PID"
echo "    get_server_list: $(echo get_server_list | $MPSENV nvidia-cuda-mps-control | tr '\n' ' ')"
mps_stop
echo "== MPS: clients sandboxed as deploy/systemd/specstated.service is (PrivateIPC=yes, ProtectSystem=strict)"
mps_start ""
RO_PIPE="unshare --mount --propagation private sh -c 'mount --bind -o ro $MPS_PIPE $MPS_PIPE && exec \"\$@\"' sh"
run mps-importer-ipc-ns "$MPSENV" "$MPSENV $IPC"
run mps-both-ipc-ns "$MPSENV $IPC" "$MPSENV $IPC"
run mps-importer-read-only-pipe-dir "$MPSENV" "$MPSENV $RO_PIPE"
mps_stop
echo "== MPS: control daemon in its own mount namespace, private /dev/shm (a sidecar with shareProcessNamespace, no shared /dev/shm)"
mps_start "$MNT"
run mps-daemon-own-mount-ns "$MPSENV" "$MPSENV"
mps_stop
echo "== MPS: control daemon in its own PID namespace (a sidecar without shareProcessNamespace)"
mps_start "$PID"
run mps-daemon-own-pid-ns "$MPSENV" "$MPSENV"
mps_stop
echo "== MPS: control daemon and clients as uid 1000"
mps_start "$U1000"
run mps-uid-1000 "$MPSENV $U1000" "$MPSENV $U1000"
run mps-uid-1000-pod "$MPSENV $MNT $U1000" "$MPSENV $MNT $U1000"
mps_stop
echo "== MPS: daemon as uid 1000, a client as uid 1001"
mps_start "$U1000"
run mps-daemon-1000-clients-1001 "$MPSENV $U1001" "$MPSENV $U1001"
mps_stop
rm -rf "$D"
