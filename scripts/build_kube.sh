#!/usr/bin/env bash
# Build a real kube-apiserver and kube-controller-manager (v1.20.2) from Debian's
# `kubernetes` source package, for the cluster tests. Nothing ships these binaries in
# the registries this machine reaches (see docs/cluster.md).
#
# The binaries are cached in $DYNMO_KUBE_BIN (default $DYNMO_KUBE_CACHE/bin, i.e.
# ~/.cache/dynmo-kube/bin) and rebuilt only when absent: a clean build took 6 min 42 s
# on this 2-core machine, source download included (docs/cluster.md). etcd comes
# ready-made from Debian's etcd-server package. Concurrent calls (CI and a test
# session) wait for one another on a lock instead of building twice.
#
# Usage: scripts/build_kube.sh            # prints the bin directory on stdout
set -euo pipefail

CACHE="${DYNMO_KUBE_CACHE:-$HOME/.cache/dynmo-kube}"
BIN="${DYNMO_KUBE_BIN:-$CACHE/bin}"
VERSION="1.20.5+really1.20.2-1.1+deb12u1"
GIT_VERSION="v1.20.2"
log() { echo "build_kube: $*" >&2; }

# install_missing cmd:package ...: apt-get the packages whose command is missing.
install_missing() {
  local need=() pair
  for pair in "$@"; do command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair#*:}"); done
  ((${#need[@]})) || return 0
  log "installing ${need[*]}"
  local SUDO=""; [[ $(id -u) == 0 ]] || SUDO="sudo"
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >&2
}
install_missing etcd:etcd-server openssl:openssl flock:util-linux   # what the tests run

# What the binaries are built from; a cache built by another recipe counts as absent
# (the first recipe left client-go's version unset: GET /version said v0.0.0-master).
RECIPE="kubernetes=$VERSION gitVersion=$GIT_VERSION version-packages=component-base,client-go"
cached() {
  [[ -x "$BIN/kube-apiserver" && -x "$BIN/kube-controller-manager" ]] &&
    [[ "$(cat "$BIN/RECIPE" 2>/dev/null)" == "$RECIPE" ]]
}
if cached; then
  log "cached in $BIN"
  echo "$BIN"; exit 0
fi

mkdir -p "$CACHE"
exec 9>"$CACHE/.build.lock"
if ! flock -n 9; then
  log "another build holds $CACHE/.build.lock; waiting for it"
  flock 9
fi
if cached; then   # built by the holder of the lock meanwhile
  log "cached in $BIN"
  echo "$BIN"; exit 0
fi
START=$SECONDS
install_missing go:golang-go rsync:rsync make:make curl:curl        # what the build needs

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
# Both version packages, as hack/lib/version.sh does: --version reads component-base's,
# but GET /version is answered by the aggregator from client-go's.
ldflags="-s -w"
for pkg in k8s.io/kubernetes/vendor/k8s.io/component-base/version \
           k8s.io/kubernetes/vendor/k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$GIT_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=20"
  ldflags+=" -X $pkg.gitTreeState=clean"
done
for cmd in kube-apiserver kube-controller-manager; do
  log "building $cmd"
  go build -ldflags "$ldflags" -o "$BIN/$cmd.tmp" "./cmd/$cmd" >&2
  mv "$BIN/$cmd.tmp" "$BIN/$cmd"
done
echo "$RECIPE" > "$BIN/RECIPE"
rm -rf "$WORK/gocache"   # ~1.3 GB, only needed for incremental rebuilds
log "built in $BIN in $((SECONDS - START)) s"
echo "$BIN"
