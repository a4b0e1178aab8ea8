#!/usr/bin/env bash
# Operator smoke test inside the CANN container: a real SGLang server on 2 NPUs with
# --plugin sglang_kvpub, its instance stream and the Motor adapter's decisions.
# Prints one PASS/FAIL line per check, the figures as JSON, then PASS or FAIL.
#
#   KVPUB_TEST_MODEL=/models/<dir> bash scripts/npu-smoke.sh [--device npu|cuda] [extra sglang args]
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}

echo "== environment"
"$PY" - <<'PY'
import importlib.util, os, shutil, subprocess, sys
print("python", sys.version.split()[0])
for mod in ("torch", "torch_npu", "sglang", "sglang_kvpub", "motor_adapter"):
    print(f"{mod:14s}", "installed" if importlib.util.find_spec(mod) else "MISSING")
if shutil.which("npu-smi"):
    out = subprocess.run(["npu-smi", "info"], capture_output=True, text=True)
    print("\n".join(out.stdout.splitlines()[:12]))
print("KVPUB_TEST_MODEL =", os.environ.get("KVPUB_TEST_MODEL", "(unset)"))
PY

if [ -z "${KVPUB_TEST_MODEL:-}" ]; then
    echo "FAIL: set KVPUB_TEST_MODEL to a local model directory"
    exit 2
fi

echo "== NPU detection (subprocess, TORCH_DEVICE_BACKEND_AUTOLOAD=0)"
DEVICE=npu
for arg in "$@"; do [ "$arg" = "cuda" ] && DEVICE=cuda; done
if ! problem=$("$PY" -c "
import sys; sys.path.insert(0, 'tests')
from npu.conftest import environment_problem
p = environment_problem('$DEVICE'); print(p or ''); sys.exit(1 if p else 0)
"); then
    echo "FAIL: $problem"
    exit 2
fi
echo "$DEVICE: ok"

echo "== scenario (server start-up can take minutes)"
exec "$PY" tests/npu/npu_engine.py --max-total-tokens "${KVPUB_TEST_MAX_TOTAL_TOKENS:-16384}" "$@"
