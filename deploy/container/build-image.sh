#!/usr/bin/env bash
# Builds the specstated image from deploy/container/Dockerfile with Debian's
# buildah (no Docker engine, no registry), then checks it with check-image.sh:
#
#   sudo deploy/container/build-image.sh [IMAGE]
#
# IMAGE defaults to localhost/specstated:latest (CPU-only binaries), or
# localhost/specstated:cuda with SPECSTATE_CUDA=1, which builds the CUDA
# backend with the host's toolkit ($CUDA_PATH, default /usr/local/cuda)
# mounted read-only into the build stage's RUN steps.
#
# 1. The Debian 12 base, localhost/specstate-base:bookworm: made once with
#    debootstrap (minbase) from $DEBIAN_MIRROR and kept as a tarball at
#    $SPECSTATE_BASE_TAR (default /var/cache/specstate/debian12-minbase.tar),
#    imported into buildah's storage (with bookworm-updates and -security
#    applied) whenever it is missing there. Both stages start from it.
# 2. buildah bud --isolation=chroot: the build stage installs the packages of
#    tools/install_deps.sh and runs Bazel on the repository; the runtime stage
#    takes the binaries and the libraries they link.
# 3. check-image.sh IMAGE (skipped with SPECSTATE_IMAGE_CHECK=0): runs
#    specstated from the image's root file system and checks health,
#    reflection, the HEALTHCHECK and a short `specstatectl simulate`.
#
# Needs root, `apt-get install buildah debootstrap`, and Debian's mirror (the
# base and both stages' apt-get). To refresh the base, delete the tarball and
# run `buildah rmi localhost/specstate-base:bookworm`.
set -euo pipefail

cuda=${SPECSTATE_CUDA:-0}
case "$cuda" in
  0) default_image=localhost/specstated:latest ;;
  1) default_image=localhost/specstated:cuda ;;
  *) echo "build-image: SPECSTATE_CUDA must be 0 or 1" >&2; exit 2 ;;
esac
image=${1:-$default_image}
base_image=localhost/specstate-base:bookworm
base_tar=${SPECSTATE_BASE_TAR:-/var/cache/specstate/debian12-minbase.tar}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
security_mirror=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
cuda_path=${CUDA_PATH:-/usr/local/cuda}

log() { echo "build-image: $*" >&2; }
[ "$(id -u)" = 0 ] || { log "run as root (buildah, debootstrap)"; exit 1; }
for tool in buildah debootstrap; do
  command -v "$tool" >/dev/null || { log "$tool not found: apt-get install buildah debootstrap"; exit 1; }
done
if [ "$cuda" = 1 ] && [ ! -x "$cuda_path/bin/nvcc" ]; then
  log "SPECSTATE_CUDA=1 but no nvcc at $cuda_path/bin/nvcc (set CUDA_PATH)"; exit 1
fi

here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../.."
tmp=$(mktemp -d /var/tmp/specstate-image.XXXXXX)
ctr=
cleanup() {
  if [ -n "$ctr" ]; then buildah rm "$ctr" >/dev/null 2>&1 || true; fi
  rm -rf "$tmp"
}
trap cleanup EXIT
start=$SECONDS

if [ ! -s "$base_tar" ]; then
  log "debootstrap Debian 12 (minbase) from $mirror"
  rootfs="$tmp/rootfs"
  debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >&2
  # Security and point-release updates for the stages' apt-get steps.
  cat >"$rootfs/etc/apt/sources.list" <<SOURCES
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb $security_mirror bookworm-security main
SOURCES
  # Like Debian's -slim images: no manuals, documentation (copyright kept) or
  # translations, neither now nor from the stages' apt-get steps.
  cat >"$rootfs/etc/dpkg/dpkg.cfg.d/specstate-slim" <<'SLIM'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
SLIM
  find "$rootfs/usr/share/doc" ! -type d ! -name copyright -delete
  rm -rf "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/*
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb
  mkdir -p "$(dirname "$base_tar")"
  tar --numeric-owner -C "$rootfs" -cf "$base_tar.part" .
  mv "$base_tar.part" "$base_tar"
  rm -rf "$rootfs"
  log "cached the base rootfs at $base_tar"
fi

if ! buildah inspect --type image "$base_image" >/dev/null 2>&1; then
  log "importing $base_tar as $base_image"
  ctr=$(buildah from scratch)
  tar --numeric-owner -C "$(buildah mount "$ctr")" -xf "$base_tar"
  buildah umount "$ctr" >/dev/null
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd /bin/bash "$ctr"
  # The cached rootfs ages: take bookworm-updates and -security at each import.
  buildah run --isolation=chroot "$ctr" -- /bin/sh -c \
    'export DEBIAN_FRONTEND=noninteractive; apt-get update && apt-get -y upgrade &&
     apt-get clean && rm -rf /var/lib/apt/lists/*' >&2
  buildah commit --quiet "$ctr" "$base_image" >/dev/null
  buildah rm "$ctr" >/dev/null
  ctr=
fi
base_done=$SECONDS

build_args=(--build-arg BASE="$base_image" --build-arg BUILD_BASE="$base_image" --build-arg CUDA="$cuda")
if [ "$cuda" = 1 ]; then
  # Only the build stage's RUN steps see it; nothing of it lands in a layer.
  build_args+=(--volume "$(readlink -f "$cuda_path"):/usr/local/cuda:ro")
fi
log "buildah bud (CUDA=$cuda) -> $image"
# Docker format keeps the HEALTHCHECK (the OCI format has no such field).
# --layers keeps the build stage's package layer for the next build.
buildah bud --isolation=chroot --format=docker --pull=never --layers \
  "${build_args[@]}" -f deploy/container/Dockerfile --tag "$image" . >&2
build_done=$SECONDS
size=$(buildah images --format '{{.Size}}' "$image" | head -n1)
log "built $image: $size; base $((base_done - start)) s, bud $((build_done - base_done)) s"

if [ "${SPECSTATE_IMAGE_CHECK:-1}" != 0 ]; then
  "$here/check-image.sh" "$image"
fi
echo "$image"
