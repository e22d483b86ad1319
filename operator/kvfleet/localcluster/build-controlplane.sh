#!/usr/bin/env bash
# Builds etcd, kube-apiserver, kube-scheduler, kube-controller-manager and kubectl from their Go
# modules through the Go module proxy (no Docker, no release downloads) and caches them.
#
# `go install k8s.io/kubernetes/cmd/...@vX` refuses: k8s.io/kubernetes requires its staging modules
# at v0.0.0 through local replace lines. The known way (kubernetes/kubernetes#79384) is a module of
# our own that requires k8s.io/kubernetes and replaces every staging module with its v0.Y.Z tag. The
# replace list is generated from k8s.io/kubernetes' own go.mod because it changes between releases.
# etcd gets a separate module: its server module has replaces of its own and its client version would
# clash with Kubernetes'.
#
# Output: $KVFLEET_CACHE/bin/<stamp>/{etcd,kube-apiserver,kube-scheduler,kube-controller-manager,kubectl}
# (KVFLEET_CACHE defaults to the ignored .cache/ of the checkout) and a symlink $KVFLEET_CACHE/bin/current.
# Rebuilt only when versions.env (beside this script) changes. A finished build is also kept in a machine-wide cache
# ($KVFLEET_MACHINE_CACHE, default ~/.cache/kvfleet) so a fresh clone on the same machine, as CI
# makes, links it in a second instead of spending six minutes compiling.
#
# helm (for the chart's e2e) is built here too, from helm.sh/helm/v3 at $HELM_VERSION, into a stamp
# of its own ($KVFLEET_CACHE/bin/helm-<version>/helm, symlink $KVFLEET_CACHE/bin/helm-current), so
# changing HELM_VERSION rebuilds only helm and changing Kubernetes never rebuilds helm.
#
# Karpenter (the node autoscaler the e2e tests and `make demo KARPENTER=1` run, kvfleet.localcluster.
# karpenter) is built here too, from sigs.k8s.io/karpenter's `kwok` command at $KARPENTER_VERSION: its
# kwok cloud provider creates Node objects instead of cloud machines, and the node agent serves them.
# Its stamp ($KVFLEET_CACHE/bin/karpenter-<version>/, symlink karpenter-current) also holds the CRDs
# of that version (NodePool, NodeClaim, KWOKNodeClass), copied from the module, so the cluster applies
# exactly the schema the binary expects.
#
# Usage: build-controlplane.sh [--without-helm] [--without-karpenter]
#   (the plain `make demo` needs neither, and skips their builds)
set -euo pipefail
with_helm=1
with_karpenter=1
for arg in "$@"; do
  case "$arg" in
    --without-helm) with_helm=0 ;;
    --without-karpenter) with_karpenter=0 ;;
    *) echo "usage: $0 [--without-helm] [--without-karpenter]" >&2; exit 2 ;;
  esac
done
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)  # the checkout: operator/kvfleet/localcluster/../../..
# shellcheck source=versions.env
source "$here/versions.env"
cache=${KVFLEET_CACHE:-$root/.cache}
stamp=k8s-${KUBERNETES_VERSION}-etcd-${ETCD_VERSION}
out=$cache/bin/$stamp
bins=(etcd kube-apiserver kube-scheduler kube-controller-manager kubectl)

machine_root=${KVFLEET_MACHINE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvfleet}
# Never let a newer `go` line in a dependency silently fetch another toolchain mid-build.
export GOTOOLCHAIN=${GOTOOLCHAIN:-local}
# The compiler is a Go program: with its collector at 400 instead of 100 it spends less time in GC.
# Measured on a 2-core machine, cold cache: the Kubernetes binaries and etcd compile in 371 s instead
# of 428 s. Memory is plenty here; a smaller machine can set GOGC=100.
export GOGC=${GOGC:-400}

# helm: `go install helm.sh/helm/v3/cmd/helm@vX` works as is (helm's module has no replace lines).
# The ldflags are those of helm's own Makefile: its version, and the Kubernetes version it assumes
# for `helm template` and `helm lint` (derived from its client-go, as the Makefile does), without
# which charts are rendered against Kubernetes 1.20.
helm_stamp=helm-$HELM_VERSION
helm_out=$cache/bin/$helm_stamp
helm_machine=$machine_root/bin/$helm_stamp
build_helm() {
  mkdir -p "$helm_out"
  if [ ! -x "$helm_out/helm" ] && [ -x "$helm_machine/helm" ]; then
    ln -f "$helm_machine/helm" "$helm_out/helm" 2>/dev/null || cp "$helm_machine/helm" "$helm_out/helm"
  fi
  if [ ! -x "$helm_out/helm" ]; then
    local mod=$cache/build/$helm_stamp
    mkdir -p "$mod"
    echo "[build] helm $HELM_VERSION"
    local gomod client_go k8s_minor ld
    gomod=$(cd "$mod" && GOFLAGS= go mod download -json "helm.sh/helm/v3@$HELM_VERSION" |
      python3 -c 'import json,sys; d=json.load(sys.stdin); print(d.get("GoMod") or sys.exit(d.get("Error", "no go.mod")))')
    client_go=$(awk '$1=="k8s.io/client-go"{print $2; exit}' "$gomod")
    [ -n "$client_go" ] || { echo "no k8s.io/client-go requirement in $gomod" >&2; exit 1; }
    k8s_minor=$(echo "$client_go" | cut -d. -f2)
    ld="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.metadata="
    ld+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
    for pkg in pkg/lint/rules pkg/chartutil; do
      ld+=" -X helm.sh/helm/v3/$pkg.k8sVersionMajor=1 -X helm.sh/helm/v3/$pkg.k8sVersionMinor=$k8s_minor"
    done
    (cd "$mod" && GOFLAGS= GOBIN="$mod/bin" go install -trimpath -ldflags "$ld" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION")
    mv "$mod/bin/helm" "$helm_out/helm"
    if [ "$helm_machine" != "$helm_out" ]; then
      mkdir -p "$helm_machine"
      ln -f "$helm_out/helm" "$helm_machine/helm" 2>/dev/null || cp "$helm_out/helm" "$helm_machine/helm"
    fi
    "$helm_out/helm" version --short
  fi
  ln -sfn "$helm_stamp" "$cache/bin/helm-current"
  echo "helm $HELM_VERSION in $helm_out"
}
[ "$with_helm" = 0 ] || build_helm

# Karpenter: `go install sigs.k8s.io/karpenter/kwok@vX` works as is (no replace lines in its go.mod).
karpenter_stamp=karpenter-$KARPENTER_VERSION
karpenter_out=$cache/bin/$karpenter_stamp
karpenter_machine=$machine_root/bin/$karpenter_stamp
karpenter_crds=(pkg/apis/crds/karpenter.sh_nodepools.yaml pkg/apis/crds/karpenter.sh_nodeclaims.yaml
                kwok/apis/crds/karpenter.kwok.sh_kwoknodeclasses.yaml)
have_karpenter() {
  [ -x "$1/karpenter" ] || return 1
  for crd in "${karpenter_crds[@]}"; do [ -f "$1/crds/$(basename "$crd")" ] || return 1; done
}
build_karpenter() {
  if ! have_karpenter "$karpenter_out" && have_karpenter "$karpenter_machine"; then
    mkdir -p "$karpenter_out/crds"
    for f in karpenter "${karpenter_crds[@]/#*\//crds/}"; do
      ln -f "$karpenter_machine/$f" "$karpenter_out/$f" 2>/dev/null || cp "$karpenter_machine/$f" "$karpenter_out/$f"
    done
  fi
  if ! have_karpenter "$karpenter_out"; then
    local mod=$cache/build/$karpenter_stamp dir
    mkdir -p "$mod" "$karpenter_out/crds"
    echo "[build] karpenter $KARPENTER_VERSION (kwok cloud provider)"
    dir=$(cd "$mod" && GOFLAGS= go mod download -json "sigs.k8s.io/karpenter@$KARPENTER_VERSION" |
      python3 -c 'import json,sys; d=json.load(sys.stdin); print(d.get("Dir") or sys.exit(d.get("Error", "no module dir")))')
    for crd in "${karpenter_crds[@]}"; do cp "$dir/$crd" "$karpenter_out/crds/"; done
    chmod u+w "$karpenter_out"/crds/*
    (cd "$mod" && GOFLAGS= GOBIN="$mod/bin" go install -trimpath -ldflags "-s -w" "sigs.k8s.io/karpenter/kwok@$KARPENTER_VERSION")
    mv "$mod/bin/kwok" "$karpenter_out/karpenter"
    if [ "$karpenter_machine" != "$karpenter_out" ]; then
      mkdir -p "$karpenter_machine/crds"
      for f in karpenter "${karpenter_crds[@]/#*\//crds/}"; do
        ln -f "$karpenter_out/$f" "$karpenter_machine/$f" 2>/dev/null || cp "$karpenter_out/$f" "$karpenter_machine/$f"
      done
    fi
  fi
  ln -sfn "$karpenter_stamp" "$cache/bin/karpenter-current"
  echo "karpenter $KARPENTER_VERSION in $karpenter_out"
}
[ "$with_karpenter" = 0 ] || build_karpenter

have_all() { for b in "${bins[@]}"; do [ -x "$out/$b" ] || return 1; done; }
machine_cache=$machine_root/bin/$stamp
mkdir -p "$out"
if ! have_all && [ -d "$machine_cache" ]; then
  for b in "${bins[@]}"; do
    [ -x "$machine_cache/$b" ] && { ln -f "$machine_cache/$b" "$out/$b" 2>/dev/null || cp "$machine_cache/$b" "$out/$b"; }
  done
fi
if have_all; then
  ln -sfn "$stamp" "$cache/bin/current"
  echo "control plane binaries cached in $out"
  exit 0
fi
export GOFLAGS=-mod=mod

minor=${KUBERNETES_VERSION#v1.}; minor=${minor%%.*}
staging_version=v0.${KUBERNETES_VERSION#v1.}
build_k8s() {
  local mod=$cache/build/k8s-$KUBERNETES_VERSION
  mkdir -p "$mod"
  echo "[build] resolving k8s.io/kubernetes@$KUBERNETES_VERSION"
  local gomod
  gomod=$(cd "$mod" && go mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
  local goline
  goline=$(awk '$1=="go"{print $2; exit}' "$gomod")
  {
    echo "// Generated by kvfleet/localcluster/build-controlplane.sh from k8s.io/kubernetes@$KUBERNETES_VERSION's go.mod; do not edit."
    echo "module kvfleet.dev/controlplane"
    echo
    echo "go $goline"
    echo
    echo "require k8s.io/kubernetes $KUBERNETES_VERSION"
    echo
    # Every requirement at v0.0.0 in Kubernetes' go.mod is a staging module (k8s.io/api, ...).
    awk '$2=="v0.0.0" && $1 ~ /^k8s\.io\// {print "replace " $1 " => " $1 " '"$staging_version"'"}' "$gomod"
  } > "$mod/go.mod"
  cat > "$mod/tools.go" <<'GO'
//go:build tools

// Package tools pins the commands this module builds.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
GO
  echo "[build] $(grep -c '^replace' "$mod/go.mod") staging replaces generated"
  (cd "$mod" && go mod tidy >/dev/null 2>&1 || go mod download)
  local ld="-s -w -X k8s.io/component-base/version.gitVersion=$KUBERNETES_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean"
  for cmd in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
    if [ ! -x "$out/$cmd" ]; then
      echo "[build] $cmd (this is the slow part on a cold machine)"
      (cd "$mod" && go build -trimpath -tags tools -ldflags "$ld" -o "$out/$cmd.tmp" "k8s.io/kubernetes/cmd/$cmd")
      mv "$out/$cmd.tmp" "$out/$cmd"
    fi
  done
}
build_etcd() {
  [ -x "$out/etcd" ] && return 0
  local mod=$cache/build/etcd-$ETCD_VERSION
  mkdir -p "$mod"
  echo "[build] etcd $ETCD_VERSION"
  (cd "$mod" && [ -f go.mod ] || (cd "$mod" && go mod init kvfleet.dev/etcd >/dev/null 2>&1))
  (cd "$mod" && go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION" >/dev/null &&
    go build -trimpath -ldflags "-s -w" -o "$out/etcd.tmp" go.etcd.io/etcd/server/v3)
  mv "$out/etcd.tmp" "$out/etcd"
}
build_etcd
build_k8s
ln -sfn "$stamp" "$cache/bin/current"
if [ "$machine_cache" != "$out" ]; then
  mkdir -p "$machine_cache"
  for b in "${bins[@]}"; do ln -f "$out/$b" "$machine_cache/$b" 2>/dev/null || cp "$out/$b" "$machine_cache/$b"; done
fi
"$out/kube-apiserver" --version
echo "control plane binaries built in $out"
