#!/usr/bin/env bash
# Offline checks of the deployment files, with no cluster, no GPU and no
# container engine:
#
#   deploy/check.sh                 # files, systemd-analyze verify, kubectl
#   sudo deploy/check.sh --image [IMAGE]   # and an image already built (check-image.sh)
#
# - deploy_files_test.py with SPECSTATE_REQUIRE_TOOLS=1: every file parsed and
#   checked against the others and the .proto; `systemd-analyze verify` on the
#   units (systemd's package; no running systemd needed); kubectl's offline
#   decoding of the manifest (`kubectl kustomize`, and the Deployment through
#   kubectl's Go types with `kubectl set env --local`). A missing tool fails
#   here, where the Bazel test (//deploy:deploy_files_test) skips.
# - bash -n on the scripts.
# - with --image: deploy/container/check-image.sh on the image.
#
# `kubectl apply/create --dry-run=client` cannot run here: even with
# --validate=false they ask the API server for its resource list.
set -euo pipefail
cd "$(dirname "$0")/.."
image=
if [ "${1:-}" = --image ]; then image=${2:-localhost/specstated:latest}; fi

echo "== kubectl $(kubectl version --client 2>/dev/null | head -n1 || echo 'not installed'); $(systemd-analyze --version 2>/dev/null | head -n1 || echo 'systemd-analyze not installed')"
SPECSTATE_REQUIRE_TOOLS=1 /usr/bin/python3 deploy/deploy_files_test.py -v
for script in deploy/container/*.sh deploy/gpu/*.sh deploy/health/*.sh deploy/check.sh; do
  bash -n "$script"
done
echo "bash -n: ok"
if [ -n "$image" ]; then
  deploy/container/check-image.sh "$image"
fi
echo "deploy/check.sh: PASS"
