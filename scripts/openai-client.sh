#!/usr/bin/env bash
# Installs the official `openai` Python client from PyPI into a virtual
# environment, for the test that speaks to `tessera serve` as users' programs
# do (cli/tests/serve.rs). Prints the environment to use it:
#
#   eval "$(scripts/openai-client.sh)"
#   cargo test -p tessera-cli --test serve the_openai_python_client
#
# The venv goes to $TESSERA_OPENAI_VENV (default: .venv-openai in the
# repository root); a second run reuses it. The version is pinned so the
# test sees the same client everywhere.
set -euo pipefail
cd "$(dirname "$0")/.."

version=3.57.0
venv=${TESSERA_OPENAI_VENV:-$PWD/.venv-openai}

if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv" >&2
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "openai==$version" >&2
"$venv/bin/python" -c "import openai" >&2

echo "export TESSERA_OPENAI_PYTHON=$venv/bin/python"
