#!/usr/bin/env bash
# Runs specstated from an image's root file system and checks what a user of
# the image relies on, with no container engine:
#
#   sudo deploy/container/check-image.sh [IMAGE]    # default localhost/specstated:latest
#
# - the image config: non-root numeric USER, ENTRYPOINT/CMD, the socket VOLUME,
#   a HEALTHCHECK that runs specstate-health; and its size;
# - specstated started with the image's ENTRYPOINT + CMD and environment, as
#   the image's USER, chrooted into the image's root file system (buildah
#   mount), so that only the image's own libraries are used; the socket
#   directory /run/specstate is a host directory bind-mounted over the volume;
# - the image's HEALTHCHECK command, run as it is written in the config;
# - `specstatectl health` and `layout`, and server reflection (listing the
#   services and describing specstate.v1.SpecState) from the host with
#   reflection_check.py, as grpcurl would;
# - `specstatectl simulate --steps=5`: its verdict must be PASS (every output
#   and state bit-identical to the stock path);
# - SIGTERM: specstated exits 0, after which the HEALTHCHECK fails.
#
# Needs root, buildah, unshare and chroot (util-linux, coreutils), and
# Debian's python3-grpcio and python3-protobuf for the reflection check.
# The CPU backend serves here (no GPU); on a CUDA image the same checks run on
# the CPU too, unless a GPU and its driver are present.
set -euo pipefail
image=${1:-localhost/specstated:latest}
here=$(cd "$(dirname "$0")" && pwd)
log() { echo "check-image: $*" >&2; }
[ "$(id -u)" = 0 ] || { log "run as root (buildah mount, chroot)"; exit 1; }

# The image's Docker config, read once: shell assignments of what is checked.
eval "$(buildah inspect --type image "$image" | /usr/bin/python3 -c '
import json, shlex, sys
config = json.load(sys.stdin)["Docker"]["config"]
words = lambda ws: " ".join(shlex.quote(w) for w in ws or [])
test = (config.get("Healthcheck") or {}).get("Test") or []
out = {
    "user": config.get("User") or "",
    "server_cmd": words((config.get("Entrypoint") or []) + (config.get("Cmd") or [])),
    "health_cmd": words(test[1:]) if test[:2] == ["CMD", "specstate-health"] else "",
    "healthcheck": json.dumps(config.get("Healthcheck")),
    "volumes": " ".join(sorted(config.get("Volumes") or {})),
    "image_env": words(config.get("Env")),
}
for key, value in out.items():
    print("%s=%s" % (key, shlex.quote(value)))
')"
size=$(buildah images --format '{{.Size}}' "$image" | head -n1)
echo "image $image: $size"
echo "  user $user; command: $server_cmd; volumes: $volumes"
echo "  healthcheck: $healthcheck"
[[ "$user" =~ ^[1-9][0-9]*:[0-9]+$ ]] || { log "USER is not a numeric non-root uid:gid: $user"; exit 1; }
[[ " $volumes " == *" /run/specstate "* ]] || { log "no /run/specstate volume"; exit 1; }
[ -n "$health_cmd" ] || { log "the HEALTHCHECK does not run specstate-health: $healthcheck"; exit 1; }

tmp=$(mktemp -d /tmp/specstate-check.XXXXXX)
ctr=$(buildah from --pull=never --quiet "$image")
cleanup() {
  buildah umount "$ctr" >/dev/null 2>&1 || true
  buildah rm "$ctr" >/dev/null 2>&1 || true
  rm -rf "$tmp"
}
trap cleanup EXIT
root=$(buildah mount "$ctr")
install -d -o "${user%%:*}" -g "${user##*:}" -m 0750 "$tmp/sock"

# Everything below runs in a private mount namespace: /proc (the CPU
# backend's pools are opened through /proc/PID/fd), /dev with a fresh
# /dev/shm (the simulator's regions) and the socket directory are mounted
# into the root file system there and vanish with it.
export root tmp user server_cmd health_cmd image_env here
unshare --mount --propagation private bash -euo pipefail -c '
mount -t proc proc "$root/proc"
mkdir -p "$root/dev" && mount --rbind /dev "$root/dev"
mount -t tmpfs -o mode=1777,size=1g shm "$root/dev/shm"
mount --bind "$tmp/sock" "$root/run/specstate"
# A subshell that becomes the command (chroot and env exec it): in the
# background, $! is then specstated itself.
in_image() ( eval "exec chroot --userspec=$user $root env -i $image_env HOME=/nonexistent $*" )
fail() { echo "check-image: FAIL: $*" >&2; exit 1; }

start=$(date +%s.%N)
eval "exec chroot --userspec=$user $root env -i $image_env HOME=/nonexistent $server_cmd" \
  >"$tmp/server.log" 2>&1 &
server=$!
for _ in $(seq 300); do
  [ -S "$tmp/sock/specstate.sock" ] && in_image "$health_cmd" >/dev/null 2>&1 && break
  kill -0 $server 2>/dev/null || fail "specstated exited: $(cat "$tmp/server.log")"
  sleep 0.1
done
printf "specstated (%s, as %s, chrooted into the image) SERVING after %.1f s\n" \
  "$server_cmd" "$user" "$(echo "$(date +%s.%N) - $start" | bc)"
sed "s/^/  server log: /" "$tmp/server.log" | head -n 5

out=$(in_image "$health_cmd") || fail "HEALTHCHECK failed: $out"
echo "HEALTHCHECK ($health_cmd): $out"
ctl="specstatectl --server=unix:///run/specstate/specstate.sock"
out=$(in_image "$ctl health") || fail "specstatectl health: $out"
echo "specstatectl health: $out"
in_image "$ctl layout" | head -n 4 | sed "s/^/specstatectl layout: /"
/usr/bin/python3 "$here/reflection_check.py" "unix://$tmp/sock/specstate.sock" ||
  fail "reflection"
sim_start=$(date +%s.%N)
in_image "$ctl simulate --steps=5 --requests=2" >"$tmp/simulate.log" 2>&1 ||
  fail "simulate exited $?: $(cat "$tmp/simulate.log")"
grep -q "^verdict: PASS" "$tmp/simulate.log" || fail "simulate: $(cat "$tmp/simulate.log")"
printf "specstatectl simulate --steps=5 --requests=2 (%.1f s): %s\n" \
  "$(echo "$(date +%s.%N) - $sim_start" | bc)" "$(grep "^verdict:" "$tmp/simulate.log")"

[ "$(cat /proc/$server/comm)" = specstated ] || fail "pid $server is not specstated"
kill -TERM $server
rc=0; wait $server || rc=$?
[ $rc = 0 ] || fail "specstated exited $rc on SIGTERM: $(tail -n 5 "$tmp/server.log")"
if in_image "$health_cmd" >/dev/null 2>&1; then fail "HEALTHCHECK passed after shutdown"; fi
echo "SIGTERM: specstated exited 0; HEALTHCHECK then fails (exit 1)"
'
echo "check-image: PASS ($image, $size)"
