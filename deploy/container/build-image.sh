#!/usr/bin/env bash
# Builds the specstated container image on this machine, with no Docker engine
# and no registry, and prints its name:
#
#   deploy/container/build-image.sh [IMAGE]      # default localhost/specstated:latest
#
# 1. bazel build //server:specstated //deploy/health:specstate-health
#    (SPECSTATE_CUDA=0 in the environment gives a CPU-only binary);
# 2. the Debian 12 base image, localhost/specstate-base:bookworm: made once with
#    debootstrap (minbase) from $DEBIAN_MIRROR and kept as a tarball at
#    $SPECSTATE_BASE_TAR (default /var/cache/specstate/debian12-minbase.tar),
#    then imported into buildah's storage whenever it is missing there;
# 3. buildah bud --isolation=chroot on deploy/container/Dockerfile.
#
# Needs root, `apt-get install buildah debootstrap`, and Debian's mirror (the
# base, and the Dockerfile's apt-get step). To refresh the base, delete the
# tarball and run `buildah rmi localhost/specstate-base:bookworm`.
set -euo pipefail

image=${1:-localhost/specstated:latest}
base_image=localhost/specstate-base:bookworm
base_tar=${SPECSTATE_BASE_TAR:-/var/cache/specstate/debian12-minbase.tar}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
security_mirror=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}

log() { echo "build-image: $*" >&2; }
[ "$(id -u)" = 0 ] || { log "run as root (buildah, debootstrap)"; exit 1; }
for tool in bazel buildah debootstrap; do
  command -v "$tool" >/dev/null || { log "$tool not found: apt-get install buildah debootstrap"; exit 1; }
done

cd "$(dirname "$0")/../.."
tmp=$(mktemp -d /var/tmp/specstate-image.XXXXXX)
ctr=
cleanup() {
  [ -n "$ctr" ] && buildah rm "$ctr" >/dev/null 2>&1
  rm -rf "$tmp"
}
trap cleanup EXIT

log "bazel build"
bazel build //server:specstated //deploy/health:specstate-health >&2
mkdir "$tmp/context"
cp deploy/container/Dockerfile "$tmp/context/"
install -m 0755 bazel-bin/server/specstated bazel-bin/deploy/health/specstate-health "$tmp/context/"

if [ ! -s "$base_tar" ]; then
  log "debootstrap Debian 12 (minbase) from $mirror"
  rootfs="$tmp/rootfs"
  debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >&2
  # Security and point-release updates for the image's apt-get step.
  cat >"$rootfs/etc/apt/sources.list" <<SOURCES
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb $security_mirror bookworm-security main
SOURCES
  # Like Debian's -slim images: no manuals, documentation (copyright kept) or
  # translations, neither now nor from the Dockerfile's apt-get step.
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

log "buildah bud"
# Docker format keeps the HEALTHCHECK (the OCI format has no such field).
buildah bud --isolation=chroot --format=docker --pull=never \
  --build-arg BASE="$base_image" --tag "$image" "$tmp/context" >&2
echo "$image"
