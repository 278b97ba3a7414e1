"""The figures of the mutation run so far, per module, as the table in docs/mutation.md.

    python tests/mutation_tally.py               # the table
    python tests/mutation_tally.py --survivors   # and every surviving mutant's name
    python tests/mutation_tally.py --redis-config  # pyproject for the Redis store's run
    python tests/mutation_tally.py --changed-since main  # the functions changed since main

Reads the verdicts mutmut keeps beside its mutated copy (.mutmut/mutants/src/**/*.meta) and
names them as mutmut does; needs mutmut installed (docs/mutation.md).
"""

import argparse
import fnmatch
import json
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ("caught by type check", "killed", "timeout", "survived", "not checked")


def verdicts(meta: Path) -> dict[str, str]:
    """Each mutant of one module and mutmut's verdict on it."""
    from mutmut.stats import status_by_exit_code  # here: the suite imports this file without it

    codes: dict[str, int | None] = json.loads(meta.read_text())["exit_code_by_key"]
    return {name: status_by_exit_code[code] for name, code in codes.items()}


def table(modules: dict[str, dict[str, str]]) -> list[str]:
    """The markdown rows: one a module, then the total."""
    head = ("module", "mutants", *COLUMNS, "other")
    rows = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    total: Counter[str] = Counter()
    for module, found in modules.items():
        counts = Counter(found.values())
        total.update(counts)
        rows.append(_row(module, len(found), counts))
    rows.append(_row("**total**", sum(total.values()), total))
    return rows


def _row(module: str, mutants: int, counts: Counter[str]) -> str:
    other = mutants - sum(counts[c] for c in COLUMNS)
    cells = (module, str(mutants), *(str(counts[c]) for c in COLUMNS), str(other))
    return "| " + " | ".join(cells) + " |"


# The two settings of pyproject's [tool.mutmut] that the Redis store's run changes: the
# Python side of store/redis/ and the leases it serves from (core/lease.py: only Redis
# leases, so only the Redis tests reach it), each mutant running the tests with "redis" in
# their id (but test_mutation_config's: they check pyproject's own settings, not these).
WITH_REDIS = (
    (
        r"^only_mutate = .*$",
        'only_mutate = ["src/fairlimit/store/redis/*", "src/fairlimit/core/lease.py"]',
    ),
    (r'"-k", "not redis"', '"-k", "redis and not mutation_config"'),
)


def redis_config(text: str) -> str:
    """pyproject.toml as the Redis store's run reads it (tests/mutate.sh --redis)."""
    for pattern, new in WITH_REDIS:
        text, found = re.subn(pattern, new, text, flags=re.MULTILINE)
        if found != 1:
            raise SystemExit(f"pyproject.toml: expected {pattern!r} once in [tool.mutmut]")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--survivors", action="store_true", help="list the surviving mutants")
    parser.add_argument("--work", default=".mutmut", help="mutmut's folder (.mutmut-redis)")
    parser.add_argument("--redis-config", action="store_true", help=redis_config.__doc__)
    parser.add_argument(
        "--changed-since", metavar="REF", help="only the mutants of the functions changed since REF"
    )
    parser.add_argument(
        "--redis",
        action="store_true",
        help="--changed-since: the functions the Redis store's run mutates",
    )
    args = parser.parse_args()
    if args.redis_config:
        print(redis_config((ROOT / "pyproject.toml").read_text()), end="")
        return
    copy = ROOT / args.work / "mutants" / "src"
    modules = {
        str(meta.relative_to(copy / "fairlimit")).removesuffix(".meta"): verdicts(meta)
        for meta in sorted(copy.glob("fairlimit/**/*.py.meta"))
    }
    if args.changed_since is not None:
        from mutation_changes import mutmut_names

        names = mutmut_names(args.changed_since, args.redis)
        modules = {
            module: {k: v for k, v in found.items() if any(fnmatch.fnmatch(k, p) for p in names)}
            for module, found in modules.items()
        }
    print("\n".join(table({m: v for m, v in modules.items() if v})))
    checked = Counter(v for found in modules.values() for v in found.values())
    run = checked["killed"] + checked["timeout"] + checked["survived"]
    if run:
        print(f"\nsurvived {checked['survived']} of {run} run ({checked['survived'] / run:.1%})")
    if args.survivors:
        for found in modules.values():
            for name, verdict in found.items():
                if verdict == "survived":
                    print(name)


if __name__ == "__main__":
    main()
