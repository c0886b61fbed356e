#!/usr/bin/env bash
# Bring up a local Docker daemon and the minimal base image the Harbor example tasks build FROM.
# Idempotent and fast when already done: installs docker.io/debootstrap only if missing, starts
# dockerd (own data root and socket) only if not answering, builds the base image only if absent.
# No image registry is reachable here, so the base image is a debootstrap'd Debian, imported.
# Prints the DOCKER_HOST to use on its last line.
#
# Usage: .ci/docker-up.sh          bring it up (as above)
#        .ci/docker-up.sh --stop   stop the dockerd this script started (its pid file under
#                                  $RLCLI_DOCKER_ROOT); images and containers stay on disk
set -euo pipefail
ROOT="${RLCLI_DOCKER_ROOT:-/var/lib/rlcli-docker}"
SOCK="$ROOT/docker.sock"
export DOCKER_HOST="unix://$SOCK"
IMAGE="${RLCLI_HARBOR_BASE_IMAGE:-rlcli-harbor-base:bookworm}"
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

case "${1:-}" in
  "") ;;
  --stop)
    if [ -O "$ROOT/dockerd.pid" ]; then SUDO=""; fi  # a dockerd of this user's: no sudo
    PID="$($SUDO cat "$ROOT/dockerd.pid" 2>/dev/null || true)"
    if [ -z "$PID" ] || ! $SUDO kill -0 "$PID" 2>/dev/null; then
      echo "docker-up: no dockerd of ours is running (no live pid in $ROOT/dockerd.pid)" >&2
      exit 0
    fi
    echo "docker-up: stopping dockerd (pid $PID)" >&2
    $SUDO kill -TERM "$PID"
    for _ in $(seq 1 60); do
      $SUDO kill -0 "$PID" 2>/dev/null || { echo "docker-up: stopped" >&2; exit 0; }
      sleep 0.5
    done
    echo "docker-up: dockerd (pid $PID) did not stop within 30s; kill -9 $PID if it must go" >&2
    exit 1
    ;;
  -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
  *) echo "docker-up: unknown argument $1 (usage: .ci/docker-up.sh [--stop])" >&2; exit 2 ;;
esac

if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
  echo "docker-up: installing docker.io and debootstrap" >&2
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq docker.io debootstrap >&2
fi

$SUDO mkdir -p "$ROOT"
if ! docker version >/dev/null 2>&1; then
  echo "docker-up: starting dockerd (socket $SOCK)" >&2
  $SUDO rm -f "$SOCK" "$ROOT/dockerd.pid"
  $SUDO bash -c "nohup dockerd --data-root '$ROOT/data' --exec-root '$ROOT/exec' \
    --host '$DOCKER_HOST' --pidfile '$ROOT/dockerd.pid' >'$ROOT/dockerd.log' 2>&1 &"
  for _ in $(seq 1 60); do
    docker version >/dev/null 2>&1 && break
    sleep 0.5
  done
  docker version >/dev/null 2>&1 || { echo "docker-up: dockerd did not start; see $ROOT/dockerd.log" >&2; tail -20 "$ROOT/dockerd.log" >&2; exit 1; }
  $SUDO chmod 666 "$SOCK" || true
fi

if ! docker image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "docker-up: building base image $IMAGE with debootstrap (a few minutes, once)" >&2
  TMP="$ROOT/rootfs.tmp"
  $SUDO rm -rf "$TMP"
  $SUDO debootstrap --variant=minbase bookworm "$TMP" http://deb.debian.org/debian >&2
  $SUDO rm -rf "$TMP/var/cache/apt/archives"/*.deb "$TMP/var/lib/apt/lists"/*
  $SUDO tar -C "$TMP" -c . | docker import -c 'CMD ["/bin/bash"]' - "$IMAGE" >&2
  $SUDO rm -rf "$TMP"
fi
echo "DOCKER_HOST=$DOCKER_HOST"
