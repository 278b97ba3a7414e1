#!/usr/bin/env bash
# Mutation testing of core/, config/ and store/ with mutmut (docs/mutation.md).
#
#   bash tests/mutate.sh run "fairlimit.core.keys*"     # one module's mutants
#   bash tests/mutate.sh results                        # the survivors so far
#   bash tests/mutate.sh show fairlimit.core.keys.x_escape__mutmut_3
#   bash tests/mutate.sh tally [--survivors]            # the figures per module (a table)
#
# mutmut works in .mutmut/ (git-ignored), where src/ links to server/: it names a mutant's
# module by the file's path and strips only a leading "src.", so the names then match the
# fairlimit.* modules the tests import. Its copy of the sources, tests and results lives in
# .mutmut/mutants/; delete that folder after changing a source file (mutmut keeps its copy).
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
if [ "${1:-}" = tally ]; then
  shift
  exec python tests/mutation_tally.py "$@"
fi
mkdir -p .mutmut
for name in tests descriptors examples pyproject.toml; do
  ln -sfn "$root/$name" ".mutmut/$name"
done
ln -sfn "$root/server" .mutmut/src
# The tests and the servers they start import fairlimit from <root>/server, the root being
# mutants/ in mutmut's copy: there server/ is the mutated src/.
mkdir -p .mutmut/mutants
ln -sfn src .mutmut/mutants/server
cd .mutmut
exec mutmut "$@"
