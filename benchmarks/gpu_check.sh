#!/usr/bin/env bash
# The prepared GPU check: run it on a machine with a CUDA GPU, from the repository root. Under 8 minutes.
#
#   1. the GPU (nvidia-smi) and a Python with CUDA torch and sglang: $PYTHON if set, else the first of
#      python3 / .venv/bin/python that imports both; else it tries `pip install sglang==$SGLANG_VERSION`
#      into benchmarks/.gpu-venv (system site packages kept, so a preinstalled CUDA torch is reused);
#   2. the gpu-marked tests: the SGLang engine against real SGLang (tests/test_engine_sglang_gpu.py:
#      log-probs vs the torch engine on the same weights, streaming, abort, release/resume, weights from
#      disk, an NCCL weight broadcast with 2+ GPUs) and a Megatron step on the GPU vs the torch trainer
#      (tests/test_megatron_gpu.py; megatron-core==0.16.1 installed if missing);
#   3. a small decode-throughput figure, SGLang vs the torch engine on the same GPU and weights
#      (benchmarks/bench_sglang.py).
# On a machine without a GPU it installs nothing and records "skipped: no GPU".
# Every step has its own time limit; a failed step is recorded and the next one still runs.
# Writes gpu_check.json (and sglang_gpu.json, gpu_tests.xml) to $OUT when set, else benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
OUT_DIR="${OUT:-benchmarks/results}"
mkdir -p "$OUT_DIR"
START=$(date +%s)
LOG="$OUT_DIR/gpu_check.log"
: >"$LOG"
note() { echo "[gpu_check +$(($(date +%s) - START))s] $*" | tee -a "$LOG"; }
BUDGET_S="${GPU_CHECK_BUDGET_S:-450}"  # the whole check, every step included (< 8 minutes)
cap() {  # seconds a step may take: its own limit, or what is left of the budget (at least 1)
  local left=$((BUDGET_S - ($(date +%s) - START)))
  [ "$left" -lt "$1" ] && echo $((left > 1 ? left : 1)) || echo "$1"
}

has_stack() { timeout "$(cap 60)" "$1" -c "import torch, sglang; assert torch.cuda.is_available()" >/dev/null 2>&1; }

GPU="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
note "gpu: ${GPU:-none visible}"
INSTALL="found"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for candidate in python3 .venv/bin/python benchmarks/.gpu-venv/bin/python; do
    if command -v "$candidate" >/dev/null 2>&1 && has_stack "$candidate"; then PY="$candidate"; break; fi
  done
fi
if [ -z "$PY" ] && [ -z "$GPU" ]; then
  INSTALL="skipped: no GPU"; PY=python3
  note "no GPU visible: nothing to check here"
elif [ -z "$PY" ]; then
  note "no python with CUDA torch + sglang; installing sglang==$SGLANG_VERSION (at most $(cap 170) s)"
  python3 -m venv --system-site-packages benchmarks/.gpu-venv >>"$LOG" 2>&1
  if timeout "$(cap 170)" benchmarks/.gpu-venv/bin/pip install -q "sglang[all]==$SGLANG_VERSION" >>"$LOG" 2>&1 \
    && timeout "$(cap 40)" benchmarks/.gpu-venv/bin/pip install -q --no-deps -e . >>"$LOG" 2>&1 \
    && has_stack benchmarks/.gpu-venv/bin/python; then
    PY=benchmarks/.gpu-venv/bin/python; INSTALL="installed"
  else
    INSTALL="failed"; PY=python3
    note "sglang install failed (no network or no CUDA torch?): see $LOG"
  fi
fi
note "python: $PY ($INSTALL)"
if { [ "$INSTALL" = found ] || [ "$INSTALL" = installed ]; } && ! "$PY" -c "import megatron.core" >/dev/null 2>&1; then
  timeout "$(cap 40)" "$PY" -m pip install -q "megatron-core==0.16.1" >>"$LOG" 2>&1 || note "megatron-core install failed"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

TESTS_RC=-1
if [ "$INSTALL" = found ] || [ "$INSTALL" = installed ]; then
  note "gpu tests (at most $(cap 180) s)"
  timeout "$(cap 180)" "$PY" -m pytest -q -m gpu tests/test_engine_sglang_gpu.py tests/test_megatron_gpu.py -p no:cacheprovider \
    --junitxml="$OUT_DIR/gpu_tests.xml" >>"$LOG" 2>&1
  TESTS_RC=$?
  note "gpu tests exit code $TESTS_RC"
  note "decode throughput (at most $(cap 120) s)"
  timeout "$(cap 120)" "$PY" benchmarks/bench_sglang.py --out "$OUT_DIR" >>"$LOG" 2>&1
  note "bench exit code $?"
fi

"${PY}" - "$OUT_DIR" "$GPU" "$INSTALL" "$SGLANG_VERSION" "$TESTS_RC" "$(($(date +%s) - START))" <<'PYEOF'
import json, sys, pathlib, xml.etree.ElementTree as ET
out, gpu, install, version, rc, seconds = sys.argv[1:]
out = pathlib.Path(out)
summary = {"gpu": gpu or None, "sglang_install": install, "sglang_pinned": version, "tests_exit_code": int(rc),
           "seconds": int(seconds)}
try:
    import sglang
    summary["sglang_version"] = getattr(sglang, "__version__", "?")
except Exception as exc:
    summary["sglang_version"] = f"not importable: {type(exc).__name__}"
junit = out / "gpu_tests.xml"
if junit.is_file():
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    summary["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    summary["failed"] = [c.get("name") for c in suite.iter("testcase") if c.find("failure") is not None
                         or c.find("error") is not None]
bench = out / "sglang_gpu.json"
if bench.is_file():
    summary["bench"] = json.loads(bench.read_text())
(out / "gpu_check.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=2))
PYEOF
