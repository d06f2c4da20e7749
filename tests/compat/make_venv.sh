#!/usr/bin/env bash
# Builds .compat/ds-<version>/: torch (the Makefile's pin) + that DeepSpeed + mpitailor (-e).
# DS_BUILD_OPS=0: no op is compiled at install; the CPU runs never JIT-build one either
# (tinytrain uses torch.optim, not DeepSpeed's CPU Adam). Idempotent (stamp file).
set -euo pipefail
ver=$1
root=$(cd "$(dirname "$0")/../.." && pwd)
venv=$root/.compat/ds-$ver
torch=${TORCH:-torch==2.13.0}
[ -f "$venv/.installed" ] && exit 0
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q "$torch"
DS_BUILD_OPS=0 "$venv/bin/pip" install -q "deepspeed==$ver" -e "$root[test]"
touch "$venv/.installed"
