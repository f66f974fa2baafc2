#!/usr/bin/env bash
# The whole test suite, the tests marked `slow` included (a plain `pytest`, as in CI,
# skips them: long multi-process, soak and stress variants whose short forms run there).
# Extra arguments go to pytest, e.g. `scripts/test_full.sh -m slow` for the slow ones only.
set -euo pipefail
cd "$(dirname "$0")/.."
KVFLOW_SLOW_TESTS=1 exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
