#!/usr/bin/env bash
# Install everything the tests need, then run the checks CI runs: ruff, the import-layering contract, pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
PYTHON=${PYTHON:-python3}
"$PYTHON" -m ruff check kvserve tests benchmarks
lint-imports
"$PYTHON" -m pytest -q -p no:cacheprovider --durations=15 "$@"
