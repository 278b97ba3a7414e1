#!/usr/bin/env bash
# Mutation testing of core/, config/ and store/ with mutmut (docs/mutation.md).
#
#   bash tests/mutate.sh run "fairlimit.core.keys*"     # one module's mutants
#   bash tests/mutate.sh results                        # the survivors so far
#   bash tests/mutate.sh show fairlimit.core.keys.x_escape__mutmut_3
#   bash tests/mutate.sh tally [--survivors]            # the figures per module (a table)
#   bash tests/mutate.sh --redis run "fairlimit.store.redis.keys*"   # store/redis/, with Redis
#   bash tests/mutate.sh --changed-since main          # the functions changed since main
#   bash tests/mutate.sh --redis --changed-since main  # ... of store/redis/ and core/lease.py
#   bash tests/mutate.sh tally --changed-since main    # their figures only
#
# mutmut works in .mutmut/ (git-ignored), where src/ links to server/: it names a mutant's
# module by the file's path and strips only a leading "src.", so the names then match the
# fairlimit.* modules the tests import. Its copy of the sources, tests and results lives in
# .mutmut/mutants/; delete that folder after changing a source file (mutmut keeps its copy).
#
# --redis works in .mutmut-redis/ instead, on the Python side of the Redis store, each mutant
# running the tests with "redis" in their id (real redis-server processes, which must be
# installed): the configuration is pyproject's with only those two settings changed.
#
# --changed-since REF runs the mutants of the functions changed since REF (git diff REF:
# committed or not; tests/mutation_changes.py names them as mutmut does), then prints their
# figures, the survival rate to quote in an issue's note.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
work=.mutmut
redis=()
if [ "${1:-}" = --redis ]; then
  shift
  work=.mutmut-redis
  redis=(--redis)
fi
if [ "${1:-}" = tally ]; then
  shift
  exec python tests/mutation_tally.py --work "$work" "${redis[@]}" "$@"
fi
since=
if [ "${1:-}" = --changed-since ]; then
  since="${2:?--changed-since needs a git ref}"
  shift 2
  names=$(python tests/mutation_changes.py mutmut "$since" "${redis[@]}")
  if [ -z "$names" ]; then
    echo "no function mutmut mutates here has changed since $since"
    exit 0
  fi
  echo "functions changed since $since:"
  echo "$names" | sed 's/^/  /'
fi
mkdir -p "$work"
for name in tests descriptors examples bench pyproject.toml; do
  ln -sfn "$root/$name" "$work/$name"
done
if [ "$work" = .mutmut-redis ]; then
  rm -f "$work/pyproject.toml"
  python tests/mutation_tally.py --redis-config > "$work/pyproject.toml"
fi
ln -sfn "$root/server" "$work/src"
# The tests and the servers they start import fairlimit from <root>/server, the root being
# mutants/ in mutmut's copy: there server/ is the mutated src/.
mkdir -p "$work/mutants"
ln -sfn src "$work/mutants/server"
cd "$work"
if [ -n "$since" ]; then
  set -f  # the patterns are mutmut's, not the shell's: one a line, none with a space
  # shellcheck disable=SC2086
  mutmut run $names
  set +f
  cd "$root"
  exec python tests/mutation_tally.py --work "$work" "${redis[@]}" --changed-since "$since"
fi
exec mutmut "$@"
