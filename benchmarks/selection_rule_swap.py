"""Do the tests of the selection step catch a rule that is timid or one that is reckless?

Runs a test file with :func:`posthoc.engine.selection.excess_bound` replaced, and checks that it fails:

- ``--rule old`` (timid): the bound before issue 44, the paired normal bound at 95 % on new data with the largest
  2.5 % of per-example gains capped, against ``tests/bench/test_selection_errors.py``: the guarded temperature then refuses
  the gains of overconfident tabular models.
- ``--rule point`` (reckless): the mean excess alone as its bound, against ``tests/engine/test_never_worse.py``: Laplace's
  prior and ``auto`` then exceed the tolerance in distribution in too many draws.

Run: ``python benchmarks/selection_rule_swap.py --rule old`` (about a minute) and ``--rule point`` (about ten
minutes on 2 cores); each prints the failing assertions and whether the test failed, as it must.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from selection_errors import RULES  # noqa: E402

import posthoc.engine.selection as selection  # noqa: E402

#: which test each replaced rule must fail
TESTS = {"old": "tests/bench/test_selection_errors.py", "point": "tests/engine/test_never_worse.py"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rule", choices=list(TESTS), required=True)
    args = parser.parse_args(argv)
    selection.excess_bound = RULES[args.rule]
    code = pytest.main(["-q", "-n", "0", "-p", "no:cacheprovider", "-W", "ignore", str(ROOT / TESTS[args.rule])])
    print(
        f"{TESTS[args.rule]} FAILS with the {args.rule} rule, as it must"
        if code == 1
        else f"unexpected: pytest exit {code} (0 would mean the test cannot tell the {args.rule} rule from the rule)"
    )
    return 0 if code == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
