#!/usr/bin/env bash
# Build a real kube-apiserver and kube-controller-manager (v1.20.2) from Debian's
# `kubernetes` source package, for the cluster tests. Nothing ships these binaries in
# the registries this machine reaches (see docs/cluster.md).
#
# The binaries are cached in $DYNMO_KUBE_CACHE (default ~/.cache/dynmo-kube/bin) and
# rebuilt only when absent: a clean build takes ~8 minutes on 2 cores. etcd comes
# ready-made from Debian's etcd-server package.
#
# Usage: scripts/build_kube.sh            # prints the bin directory on stdout
set -euo pipefail

CACHE="${DYNMO_KUBE_CACHE:-$HOME/.cache/dynmo-kube}"
BIN="$CACHE/bin"
VERSION="1.20.5+really1.20.2-1.1+deb12u1"
GIT_VERSION="v1.20.2"
log() { echo "build_kube: $*" >&2; }

need_pkgs=()
for pair in etcd:etcd-server go:golang-go rsync:rsync make:make openssl:openssl curl:curl; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || need_pkgs+=("${pair#*:}")
done
if ((${#need_pkgs[@]})); then
  log "installing ${need_pkgs[*]}"
  SUDO=""; [[ $(id -u) == 0 ]] || SUDO="sudo"
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_pkgs[@]}" >&2
fi

if [[ -x "$BIN/kube-apiserver" && -x "$BIN/kube-controller-manager" ]]; then
  log "cached in $BIN"
  echo "$BIN"; exit 0
fi

WORK="$CACHE/build"
mkdir -p "$WORK" "$BIN"
if ! compgen -G "$WORK/kubernetes_*.orig.tar.*" >/dev/null; then
  # A private apt configuration with one deb-src entry, on the mirror the machine's
  # own sources already name (no host name is written here).
  uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
  apt_dir="$WORK/apt"; mkdir -p "$apt_dir/lists/partial" "$apt_dir/archives/partial"
  echo "deb-src $uri bookworm main" > "$apt_dir/sources.list"
  cat > "$apt_dir/apt.conf" <<CONF
Dir::Etc::SourceList "$apt_dir/sources.list";
Dir::Etc::SourceParts "/nonexistent";
Dir::State::Lists "$apt_dir/lists";
Dir::Cache::Archives "$apt_dir/archives";
APT::Get::Only-Source "true";
CONF
  log "downloading the kubernetes source package ($VERSION)"
  APT_CONFIG="$apt_dir/apt.conf" apt-get update -qq >&2
  (cd "$WORK" && APT_CONFIG="$apt_dir/apt.conf" apt-get source --download-only -qq "kubernetes=$VERSION" >&2)
fi

GOPATH="$WORK/gopath"
SRC="$GOPATH/src/k8s.io/kubernetes"
if [[ ! -f "$SRC/cmd/kube-apiserver/apiserver.go" ]]; then
  log "unpacking"
  rm -rf "$WORK/tree" && mkdir -p "$WORK/tree" "$(dirname "$SRC")"
  tar -xf "$WORK"/kubernetes_*.orig.tar.* -C "$WORK/tree" --strip-components=1
  ln -sfn "$WORK/tree" "$SRC"
fi

export GOPATH GO111MODULE=off CGO_ENABLED=0 GOFLAGS="" GOCACHE="$WORK/gocache"
cd "$SRC"
if [[ ! -f pkg/generated/openapi/zz_generated.openapi.go ]]; then
  log "generating openapi definitions"
  make gen_openapi >&2
fi
pkg=k8s.io/kubernetes/vendor/k8s.io/component-base/version
ldflags="-s -w -X $pkg.gitVersion=$GIT_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=20"
for cmd in kube-apiserver kube-controller-manager; do
  log "building $cmd"
  go build -ldflags "$ldflags" -o "$BIN/$cmd.tmp" "./cmd/$cmd" >&2
  mv "$BIN/$cmd.tmp" "$BIN/$cmd"
done
rm -rf "$WORK/gocache"   # ~1.3 GB, only needed for incremental rebuilds
log "built in $BIN"
echo "$BIN"
