#!/usr/bin/env bash
# gpu-check.sh: throughput profile of the 20M and ~100M presets on one NVIDIA GPU, with the
# throughput-optimal micro-batch per global batch. For a machine with a GPU, no network and no
# Rust toolchain; it runs a `recipes` binary built beforehand.
#
# Build (on a machine with Rust, network and a C toolchain; Burn's CUDA build fetches LLVM):
#     cargo build --profile dist -p recipes --features cuda
# The `dist` profile strips symbols; the binary is target/dist/recipes (check it is under
# 64 MiB: `du -m target/dist/recipes`).
# Copy both files to the GPU machine, next to each other:
#     scp target/dist/recipes scripts/gpu-check.sh gpu-host:copus/
# Run there:
#     cd copus && ./gpu-check.sh            # or COPUS_BIN=/path/to/recipes ./gpu-check.sh
# Needs on the GPU machine: the NVIDIA driver (libcuda.so) and NVRTC (libnvrtc.so, from the
# CUDA toolkit or the nvidia-cuda-nvrtc wheel); CubeCL compiles its kernels at run time.
# Results go to ./gpu-check-out/ (profiles as RON and CSV) and to stdout.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
bin="${COPUS_BIN:-$here/recipes}"
out="${COPUS_OUT:-$PWD/gpu-check-out}"
steps="${COPUS_PROFILE_STEPS:-3}"

fail() { echo "gpu-check: $*" >&2; exit 1; }

[ -x "$bin" ] || fail "no recipes binary at $bin (build it with: cargo build --profile dist -p recipes --features cuda; or set COPUS_BIN)"
command -v nvidia-smi >/dev/null 2>&1 || fail "nvidia-smi not found: this machine has no NVIDIA driver, so no GPU to measure"
gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
[ "$gpus" -ge 1 ] || fail "nvidia-smi lists no GPU ($(nvidia-smi -L 2>&1 | head -1))"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1 | sed 's/^/gpu-check: GPU 0: /'
mem_gib="$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | awk '{printf "%d", $1 / 1024 * 0.9}')"

mkdir -p "$out"
recipe() { # name preset seq global_batches micro_batches
  cat > "$out/$1.ron" <<RON
(
    name: "$1",
    output_dir: "$out",
    model: (preset: "$2", seq_len: Some($3)),
    train: (global_batch: 8, micro_batch: 1, max_steps: 1),
    backend: Cuda,
    parallel: (
        world_size: 1,
        layout: Some((dp: 1, tp: 1, pp: 1)),
        global_batches: $4,
        micro_batches: $5,
        device_memory_gib: $mem_gib,
        profile_steps: $steps,
    ),
)
RON
}
recipe gpu-20m tiny-20m 512 "[8, 16, 32, 64, 128]" "[1, 2, 4, 8, 16, 32]"
recipe gpu-100m small-100m 1024 "[8, 16, 32, 64]" "[1, 2, 4, 8, 16]"

for r in gpu-20m gpu-100m; do
  echo "gpu-check: profiling $r (every feasible B_g x B_m, $steps timed steps each)"
  "$bin" profile "$out/$r.ron" --out "$out/$r-profile.ron" || fail "profiling $r failed (see above)"
done
echo "gpu-check: done; profiles in $out"
