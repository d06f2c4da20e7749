#!/bin/bash
# The GPU runs of issue 35 on a lent machine (no internet, no DeepSpeed installed): run from
# the repo root with the wheels of bench/README.md#gpu-check in .whl/ and $OUT set. Installs
# them, then (1) gpu_check's zero3-bf16 part, whose overlapped asynchronous saves must equal
# the synchronous ones, (2) the save loop on the GPU, at >= 1 GB per save. Each under its
# own timeout; what it wrote comes back in $OUT.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl || exit 1
python3 -m zipfile -e .whl/mpich-5.0.2-*.whl /tmp/mpich  # pip --target drops its lib/
export PYTHONPATH=$PWD:/tmp/site MPI4PY_LIBMPI=/tmp/mpich/mpich-5.0.2.data/data/lib/libmpi.so.12
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nproc; free -g | head -2; df -h . /tmp | tail -2
# the disk the saves go to: 2 GB written and fsynced (context for the full save's time)
dd if=/dev/zero of=bench/dd.tmp bs=16M count=128 conv=fsync 2>&1 | tail -1; rm -f bench/dd.tmp

timeout "${GPU_CHECK_S:-150}" python3 -m bench.gpu_check --only zero3-bf16 \
    --out "$OUT/gpu_check_overlap.json" --workdir /tmp/gcw 2>&1 | tee "$OUT/gpu_check.log"

timeout "${SAVE_BENCH_S:-240}" python3 -m bench.save_bench --device cuda --world-size 1 \
    --layers 32 --hidden 1024 --vocab 2048 --seq-len 256 --steps 31 --every 10 --reps 2 \
    2>&1 | tee "$OUT/save_bench_cuda.log"
cp bench/out/save_bench_cuda.json "$OUT/" 2>/dev/null || \
    cat /tmp/mpitailor-train-*/rank0.log 2>/dev/null | tail -40  # timed out: rows so far
