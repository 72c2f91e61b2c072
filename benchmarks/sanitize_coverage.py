"""Which tests ran clean under compute-sanitizer, from gpu_run.sh's sanitize logs.

    python sanitize_coverage.py LOG... [--tests ../tests/test_row_norm.py ...]

A test counts for a tool when it passed (or was skipped) in a shard whose process
ended normally with that tool's summary at zero: a shard that crashed or was cut
may have stopped before the tool reported. The logs are the joined
`sanitizer_<tool>.log` files (one "==== shard I/N" section a process), written
with sanitize_plugin.py, which names each test as it ends. Prints, per tool, the
tests covered out of those collected, and any left.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

_CLEAN = {
    "memcheck": "ERROR SUMMARY: 0 errors",
    "racecheck": "RACECHECK SUMMARY: 0 hazards",
}
# (ids may hold ": " themselves: a dict among the parameters)
_TEST_ENDED = re.compile(r"^(.)gpu memory after (\S+?::.*): process \d+ MiB", re.M)


def collected_ids(test_files: list[str]) -> list[str]:
    """`file.py::test[params]` of each test, as pytest collects them."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            *test_files,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [line.split("/")[-1] for line in out.splitlines() if "::" in line]


def clean_tests(log: str) -> dict[str, set[str]]:
    """Tool -> tests that passed or skipped in the log's clean shards."""
    covered: dict[str, set[str]] = {}
    for section in re.split(r"^==== shard \d+/\d+$", log, flags=re.M):
        if "exit status 0" not in section:
            continue
        for tool, summary in _CLEAN.items():
            if summary in section:
                covered.setdefault(tool, set()).update(
                    test for result, test in _TEST_ENDED.findall(section) if result in ".s"
                )
    return covered


def main() -> None:
    here = Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument(
        "--tests",
        nargs="+",
        default=[str(here.parent / "tests" / f) for f in ("test_row_norm.py", "test_add_norm.py")],
    )
    args = parser.parse_args()
    ids = collected_ids(args.tests)
    covered: dict[str, set[str]] = {}
    for path in args.logs:
        for tool, tests in clean_tests(path.read_text(errors="replace")).items():
            covered.setdefault(tool, set()).update(tests)
    for tool, tests in sorted(covered.items()):
        left = [t for t in ids if t not in tests]
        print(f"{tool}: {len(ids) - len(left)} of {len(ids)} tests ran clean")
        for test in left:
            print(f"  not covered: {test}")


if __name__ == "__main__":
    main()
