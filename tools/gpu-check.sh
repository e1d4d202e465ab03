#!/usr/bin/env bash
# On a machine with a real NVIDIA GPU (not part of CI): does slotctl see the GPUs as
# nvidia-smi does, and does a slot pinned to GPU 0 really run there?
#
#   1. the NVML probe's figures (index, UUID, total, free) against
#      `nvidia-smi --query-gpu=index,uuid,memory.total,memory.free --format=csv`;
#   2. one slot pinned to GPU 0 (device = "gpu:0") through the real controller on the
#      process runtime: a demo server holding 512 MiB of GPU memory (tools/gpu_ballast.py),
#      or llama-server with GGUF=/path/model.gguf when `llama-server` is on PATH; then
#      `nvidia-smi --query-compute-apps` must list its pid on GPU 0's UUID, and only there.
#
# Needs the package installed with its NVIDIA extra (pip install -e '.[nvidia]');
# PYTHON picks the interpreter (default .venv/bin/python). Exit 0: all checks passed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
command -v nvidia-smi >/dev/null || { echo "gpu-check: no nvidia-smi on this machine" >&2; exit 2; }
tmp="$(mktemp -d)"
ctl=("$PYTHON" -m controller --config-dir "$tmp/config" --state-dir "$tmp/state")
trap '"${ctl[@]}" down >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT

echo "== 1. the NVML probe against nvidia-smi"
nvidia-smi --query-gpu=index,uuid,memory.total,memory.free --format=csv,noheader,nounits \
    > "$tmp/smi.csv"
cat "$tmp/smi.csv"
"$PYTHON" - "$tmp/smi.csv" <<'PY'
import sys
from controller.probes.memory import NvmlProbe

MIB = 1024**2
probe = NvmlProbe()
gpus = probe.gpus()
if not gpus:
    sys.exit(f"gpu-check: the NVML probe sees no GPU ({probe.error})")
rows = [line.split(", ") for line in open(sys.argv[1]).read().splitlines() if line.strip()]
assert len(rows) == len(gpus), f"nvidia-smi lists {len(rows)} GPUs, the probe {len(gpus)}"
for (index, uuid, total, free), gpu in zip(rows, gpus):
    print(f"  gpu:{gpu.index} {gpu.uuid} {gpu.name}: total {gpu.total_bytes // MIB} MiB, "
          f"free {gpu.free_bytes // MIB} MiB (nvidia-smi: {total}, {free})")
    assert gpu.error is None, gpu.error
    assert int(index) == gpu.index and uuid == gpu.uuid, (index, uuid, gpu)
    assert abs(int(total) - gpu.total_bytes // MIB) <= 1, (total, gpu.total_bytes)
    assert abs(int(free) - gpu.free_bytes // MIB) <= 256, (free, gpu.free_bytes)  # it moves
print("  ok: the probe's GPUs are nvidia-smi's")
PY

echo "== 2. a slot pinned to GPU 0 runs on GPU 0"
port="$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
if command -v llama-server >/dev/null && [ -n "${GGUF:-}" ]; then
    server="provider = \"llamacpp\"
model.default = \"m\""
    model="[[model]]
id = \"m\"
source = \"$GGUF\"
memory_gb = 1"
else
    server="provider = \"openai-compatible\"
model.default = \"m\"
[slot.server]
cmd = [\"$PYTHON\", \"$PWD/tools/gpu_ballast.py\", \"--mb\", \"512\", \"--\", \"--host\", \"{host}\", \"--port\", \"{port}\", \"--model\", \"{model_id}\"]"
    model="[[model]]
id = \"m\"
source = \"demo://m\"
memory_gb = 1"
fi
cat > "$tmp/gpu.toml" <<TOML
[stack]
name = "gpu-check"
$model
[[slot]]
name = "pinned"
device = "gpu:0"
port = $port
$server
TOML
env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "${ctl[@]}" stack apply "$tmp/gpu.toml" --once --timeout 120
pid="$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["pid"])' "$tmp/state/slots/pinned/process.json")"
uuid0="$(sed -n 1p "$tmp/smi.csv" | cut -d, -f2 | tr -d ' ')"
sleep 1
nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader | tee "$tmp/apps.csv"
grep -q "^$pid, $uuid0," "$tmp/apps.csv" \
    || { echo "gpu-check: pid $pid holds no memory on GPU 0 ($uuid0)" >&2; exit 1; }
if grep "^$pid, " "$tmp/apps.csv" | grep -vq "$uuid0"; then
    echo "gpu-check: pid $pid holds memory on another GPU too" >&2; exit 1
fi
"${ctl[@]}" slot list
echo "gpu-check: all checks passed"
