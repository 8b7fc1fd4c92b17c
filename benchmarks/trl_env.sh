#!/usr/bin/env bash
# The TRL peer's own environment, .venv-trl at the checkout's root beside .venv (git-ignored), used only by
# benchmarks/trl_peer.py, which benchmarks/throughput.py runs as a subprocess.
#
#   bash benchmarks/trl_env.sh            # create or complete it (idempotent)
#   PY=python3.11 bash benchmarks/trl_env.sh
#
# torch is installed FIRST and pinned to the main venv's version (the CPU build on these
# machines), so that nothing below pulls another torch; the TRL stack is pinned to versions
# checked with `pip install --dry-run` to leave torch alone. The main venv never sees TRL.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${VENV:-$(dirname "$HERE")/.venv-trl}"
PY="${PY:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
# requests: trl 1.13.0 imports it (its vLLM client) without declaring it
PINS=(trl==1.13.0 transformers==5.23.0 datasets==5.2.0 accelerate==1.15.0 requests==2.34.2)

test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"$VENV/bin/python" -c "import torch" 2>/dev/null || "${PIP[@]}" install -q "torch==$TORCH_VERSION"
before="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
"${PIP[@]}" install -q "${PINS[@]}"
after="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
if [ "$before" != "$after" ]; then
    echo "trl_env.sh: installing ${PINS[*]} changed torch $before -> $after; fix the pins" >&2
    exit 1
fi
"$VENV/bin/python" -c "import trl, transformers, datasets, accelerate, torch; \
print('trl', trl.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
