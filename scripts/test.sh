#!/usr/bin/env bash
# Install everything the tests need, then run the checks CI runs: ruff, the import-layering contract, pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
# The real models the tests compare with transformers (kept in the model store between runs). Without them
# those tests skip, unless KVSERVE_REQUIRE_MODELS is set (CI), where they fail.
for model in qwen2.5-coder-0.5b gemma-3-270m; do
    "${PYTHON:-python3}" -m kvserve models pull "$model" --quiet || echo "warning: could not pull $model" >&2
done
PYTHON=${PYTHON:-python3}
"$PYTHON" -m ruff check kvserve tests benchmarks
lint-imports
"$PYTHON" -m pytest -q -p no:cacheprovider --durations=15 "$@"
