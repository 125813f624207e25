#!/usr/bin/env bash
# gpu-check.sh: copus on one NVIDIA GPU, from a bundle built elsewhere, in under 10 minutes.
# For a machine with a GPU, no network, no Rust toolchain and PyTorch in its Python.
#
# Build the bundle (on a machine with Rust and the package registries; see docs/gpu.md, "The
# GPU check"):
#     scripts/build-gpu-bundle.sh            # writes target/gpu-bundle.tar.gz
# Copy it to the GPU machine, unpack and run:
#     tar xzf gpu-bundle.tar.gz && cd gpu-bundle && ./gpu-check.sh
#
# The bundle has two builds of `recipes`, one per GPU backend (neither needs LLVM to build):
# - recipes-tch, backend `Tch`: Burn's LibTorch backend, linked against the libtorch of a
#   PyTorch wheel and run against the libtorch of this machine's PyTorch (found with
#   `python3 -c 'import torch'`, or COPUS_LIBTORCH=/path/to/torch/lib); the versions must match
#   (`torch-version` in the bundle);
# - recipes-wgpu, backend `Wgpu`: Vulkan through the
#   loader in the bundle's lib/ (Debian's libvulkan1) and the NVIDIA driver's Vulkan ICD (its
#   json, or one written here for libGLX_nvidia.so.0).
# For each: `recipes bench device`, which trains tiny-1m three steps on the GPU and on the CPU
# (Flex) on serial, dp2, tp2, pp2, dp2 x tp2 and tp2 x pp2 and fails on a NaN or a difference
# of a step's loss or gradient norm above 1e-4, then measures samples/s, model-FLOPs
# utilisation and host bytes per step of tiny-20m and small-100m on 1 and 8 ranks sharing the
# GPU, in f32 and bf16 (wgpu: f32 only); on LibTorch, small-100m and the 1B preset
# (tinyllama-1.1b, with activation checkpointing) in bf16 on one rank beside PyTorch on the same
# GPU (bench/torch_step.py: eager, eager with SDPA and fused AdamW, torch.compile), tokens/s,
# utilisation, peak memory and the ratio. The GPU's memory in use is sampled through each part
# (nvidia-smi) and its peak printed; the wgpu part fails where it left the GPU's memory alone
# (wgpu fell back to a CPU adapter). Then, on
# LibTorch, `recipes bench memory --backend Tch`: the peak memory on the GPU of tiny-20m and
# small-100m on several layouts, micro-batches, with and without checkpointing and ZeRO-1, in
# f32 and bf16, each beside the memory model's prediction. Last, `recipes run` of
# parallel-tiny-gpu.ron: Copus training tiny-1m on the Shakespeare plays (in the bundle) with 8
# ranks on the GPU, changing layout and batch size live; its summary is printed.
#
# Without a GPU: `./gpu-check.sh --cpu` runs the same checks on LibTorch's CPU device (and on
# lavapipe, where Mesa's Vulkan driver is installed) with tiny-1m, to check the bundle itself.
# Without PyTorch the Tch part is skipped (and reported as failed); recipes-wgpu needs none.
# `--only Tch` (or Wgpu, TchCpu) runs one backend's parts.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
out="${COPUS_OUT:-$PWD/gpu-check-out}"
cpu=0
only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) cpu=1 ;;
    --only)
      [ $# -ge 2 ] || { echo "gpu-check: --only takes Tch, Wgpu or TchCpu" >&2; exit 2; }
      only="$2"
      shift
      ;;
    *) echo "usage: gpu-check.sh [--cpu] [--only Tch|Wgpu|TchCpu]" >&2; exit 2 ;;
  esac
  shift
done

fail() { echo "gpu-check: FAILED: $*" >&2; exit 1; }
say() { echo "gpu-check: $*"; }

for b in recipes-tch recipes-wgpu; do
  [ -x "$here/$b" ] || fail "no $b next to this script (build the bundle with scripts/build-gpu-bundle.sh)"
done
mkdir -p "$out"
out="$(cd "$out" && pwd)"

# LibTorch: this machine's PyTorch, whose version must be the one the bundle was built against.
status=0
no_torch=""
libtorch="${COPUS_LIBTORCH:-}"
if [ -z "$libtorch" ]; then
  py="$(command -v python3 || command -v python || true)"
  if [ -z "$py" ]; then
    no_torch="no python3 to find PyTorch's libtorch (or set COPUS_LIBTORCH to its lib directory)"
  elif ! libtorch="$("$py" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>/dev/null)"; then
    no_torch="python3 cannot import torch (or set COPUS_LIBTORCH to a libtorch lib directory)"
  else
    have="$("$py" -c 'import torch; print(torch.__version__.split("+")[0])')"
    want="$(cat "$here/torch-version" 2>/dev/null || echo unknown)"
    if [ "$want" != unknown ] && [ "$have" != "$want" ]; then
      no_torch="this machine's PyTorch is $have; the bundle was built against $want (rebuild it against $have)"
    else
      say "LibTorch from PyTorch $have at $libtorch"
    fi
  fi
fi
[ -n "$no_torch" ] || [ -f "$libtorch/libtorch.so" ] || no_torch="no libtorch.so in $libtorch"
if [ -n "$no_torch" ]; then
  say "Tch: skipped: $no_torch"
  status=1
else
  export LD_LIBRARY_PATH="$libtorch${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

if [ "$cpu" = 1 ]; then
  backends="TchCpu"
  # lavapipe, where Mesa's Vulkan driver is installed.
  if compgen -G '/usr/share/vulkan/icd.d/lvp_icd*' >/dev/null || compgen -G '/etc/vulkan/icd.d/lvp_icd*' >/dev/null; then
    backends="$backends Wgpu"
  else
    say "Wgpu: skipped: no lavapipe (Mesa's mesa-vulkan-drivers) on this machine"
  fi
  presets=(--preset tiny-1m)
  ranks=2
  peaks=()
else
  command -v nvidia-smi >/dev/null 2>&1 || fail "nvidia-smi not found: no NVIDIA driver on this machine (run with --cpu to check the bundle without a GPU)"
  gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
  [ "$gpus" -ge 1 ] || fail "nvidia-smi lists no GPU ($(nvidia-smi -L 2>&1 | head -1))"
  name="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
  say "GPU 0: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"
  # Peak dense TFLOP/s (f32 without tensor cores, bf16 with), from the vendor's data sheets.
  case "$name" in
    *H200* | *H100*SXM* | *H100\ 80GB\ HBM3*) peaks=(--peak-tflops 67,989) ;;
    *H100*) peaks=(--peak-tflops 51,756) ;;
    *A100*) peaks=(--peak-tflops 19.5,312) ;;
    *) peaks=(); say "no peak FLOP/s known for $name: utilisation not computed" ;;
  esac
  backends="Tch Wgpu"
  presets=(--preset tiny-20m --preset small-100m)
  ranks=8
  # The NVIDIA driver's Vulkan ICD: the json of the driver's own folder where containers mount
  # it (/usr/local/nvidia), else one where the loader looks, else one written here for its
  # libGLX_nvidia.so.0. The ICD loads libglvnd's dispatch libraries, which the bundle's lib/ has.
  if [ -z "${VK_ICD_FILENAMES:-}" ] && [ -z "${VK_DRIVER_FILES:-}" ]; then
    mounted="$(compgen -G '/usr/local/nvidia/share/vulkan/icd.d/nvidia*.json' | head -1 || true)"
    glx="$(ldconfig -p 2>/dev/null | awk '/libGLX_nvidia.so.0/ && !f {print $NF; f = 1}' || true)"
    [ -n "$glx" ] || glx="$(compgen -G '/usr/local/nvidia/lib64/libGLX_nvidia.so.0' | head -1 || true)"
    if [ -n "$mounted" ]; then
      export VK_DRIVER_FILES="$mounted" VK_ICD_FILENAMES="$mounted"
      say "Vulkan: the driver's ICD json at $mounted"
    elif compgen -G '/usr/share/vulkan/icd.d/nvidia*' >/dev/null || compgen -G '/etc/vulkan/icd.d/nvidia*' >/dev/null; then
      say "Vulkan: the driver's ICD json where the loader looks"
    elif [ -n "$glx" ]; then
      printf '{"file_format_version": "1.0.0", "ICD": {"library_path": "%s", "api_version": "1.3"}}\n' "$glx" > "$out/nvidia_icd.json"
      export VK_DRIVER_FILES="$out/nvidia_icd.json" VK_ICD_FILENAMES="$out/nvidia_icd.json"
      say "Vulkan: the driver's ICD json was missing; wrote $out/nvidia_icd.json for $glx"
    else
      say "Vulkan: no NVIDIA ICD (json or libGLX_nvidia.so.0); the Wgpu part may fail"
    fi
  fi
  egl="$(compgen -G '/usr/local/nvidia/share/glvnd/egl_vendor.d/*nvidia*.json' | head -1 || true)"
  [ -z "$egl" ] || [ -n "${__EGL_VENDOR_LIBRARY_FILENAMES:-}" ] || export __EGL_VENDOR_LIBRARY_FILENAMES="$egl"
fi

if [ -n "$only" ]; then
  case " $backends " in
    *" $only "*) ;;
    *) fail "--only $only: this mode runs $backends" ;;
  esac
fi

# Memory in use on every GPU (MiB) while a part runs, sampled every 200 ms as `index, MiB`
# lines; the sampler stops with the script, however it ends. A part's peak is the largest rise
# over what each GPU had in use before it (LibTorch takes the first GPU of CUDA_VISIBLE_DEVICES,
# which nvidia-smi may number otherwise, and wgpu the first Vulkan adapter, which ignores it;
# on a shared multi-GPU node another job's rise may be taken for the part's).
query=(--query-gpu=index,memory.used --format=csv,noheader,nounits)
sample() { nvidia-smi "${query[@]}" -lms 200 > "$1" 2>/dev/null & echo $!; }
# The largest rise of a GPU's memory in use from $1 (before) to the peak in $2 (samples), and
# that GPU's peak, as `rise peak index`; nothing where either file has no number.
rise() {
  awk -F', *' 'FILENAME == ARGV[1] { if ($2 ~ /^[0-9]+$/) base[$1] = $2; next }
    $2 ~ /^[0-9]+$/ && ($1 in base) { if (!($1 in peak) || $2 > peak[$1]) peak[$1] = $2 }
    END { best = ""; for (i in peak) { r = peak[i] - base[i]; if (best == "" || r > best) { best = r; p = peak[i]; g = i } }
          if (best != "") print best, p, g }' "$1" "$2"
}
sampler=""
trap '[ -z "$sampler" ] || kill "$sampler" 2>/dev/null || true' EXIT
# One part: a name, its time limit in seconds, then the command; its output is printed and
# kept in $out/NAME.md, the GPU's memory in use sampled while it runs. Fails the check on an
# error, the limit or a NaN.
part() {
  local name="$1" limit="$2" rc grew up top gpu
  shift 2
  say "$name (at most $limit s; log: $out/$name.md)"
  if [ "$cpu" != 1 ]; then
    nvidia-smi "${query[@]}" > "$out/$name-memory-before.txt" 2>/dev/null || true
    sampler="$(sample "$out/$name-memory.txt")"
  fi
  set +e
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.md"
  rc=${PIPESTATUS[0]}
  set -e
  if [ -n "$sampler" ]; then
    kill "$sampler" 2>/dev/null || true
    sampler=""
    grew="$(rise "$out/$name-memory-before.txt" "$out/$name-memory.txt" 2>/dev/null || true)"
    if [ -z "$grew" ]; then
      say "$name: peak memory in use not sampled (nvidia-smi gave no numbers)"
    else
      read -r up top gpu <<< "$grew"
      say "$name: peak memory in use on GPU $gpu: $top MiB ($up MiB more than before the part)"
      # wgpu takes the first adapter its graphics API offers that is not a CPU, else a CPU one
      # (lavapipe): a run that left every GPU's memory alone ran on the CPU.
      if [ "$name" = Wgpu ] && [ "$up" -lt 256 ]; then
        say "Wgpu: FAILED (no GPU's memory in use rose by 256 MiB: wgpu ran on another adapter, a CPU one such as lavapipe?)"
        status=1
      fi
    fi
  fi
  if [ "$rc" != 0 ]; then
    say "$name: FAILED (exit $rc; 124 is the $limit s limit)"
    status=1
  elif grep -qiw 'nan' "$out/$name.md"; then
    say "$name: FAILED (a NaN in the output)"
    status=1
  fi
}

# The parts in order of importance, each limited so that the whole check ends within 10 minutes.
for backend in $backends; do
  case "$backend" in Tch*) [ -z "$no_torch" ] || continue ;; esac
  [ -z "$only" ] || [ "$only" = "$backend" ] || continue
  bin="$here/recipes-wgpu"
  case "$backend" in Tch*) bin="$here/recipes-tch" ;; esac
  limit=110
  [ "$backend" = Wgpu ] && limit=120
  part "$backend" "$limit" "$bin" bench device --backend "$backend" "${presets[@]}" --ranks "$ranks" --steps 3 --no-torch ${peaks[@]+"${peaks[@]}"}
  # Beside PyTorch on the same device, one rank, bf16: eager with the masked softmax, eager with
  # SDPA and fused AdamW, torch.compile, each stepping in turn with copus (on the CPU: tiny-1m
  # in f32, to check the bundle's PyTorch side).
  case "$backend" in
    Tch)
      part Tch-vs-PyTorch 80 "$bin" bench device --backend Tch --throughput-only --preset small-100m --ranks 1 \
        --global-batch 32 --micro-batch 8 --precision bf16 --steps 10 ${peaks[@]+"${peaks[@]}"}
      part Tch-1b-vs-PyTorch 110 "$bin" bench device --backend Tch --throughput-only --preset tinyllama-1.1b --ranks 1 \
        --global-batch 8 --micro-batch 4 --precision bf16 --checkpointing --steps 10 ${peaks[@]+"${peaks[@]}"}
      ;;
    TchCpu)
      part TchCpu-vs-PyTorch 120 "$bin" bench device --backend TchCpu --throughput-only --preset tiny-1m --ranks 1 \
        --global-batch 4 --micro-batch 2 --precision f32 --steps 3
      ;;
  esac
  # Peak memory against the memory model, each configuration in a process of its own.
  if [ "$backend" = Tch ]; then
    part Tch-memory 100 "$bin" bench memory --backend Tch
  fi
  # Copus itself: parallel-tiny-gpu (tiny-1m on Shakespeare, 8 ranks sharing the device,
  # layout and batch size changed live), from the bundle's corpus; on the CPU 40 steps.
  case "$backend" in
    Tch | TchCpu)
      if ! { rm -rf "$out/copus" && mkdir -p "$out/copus" && cp -r "$here/cache" "$out/copus/cache" \
        && sed "s/backend: Tch,/backend: $backend,/" "$here/parallel-tiny-gpu.ron" > "$out/copus/recipe.ron"; }; then
        say "$backend-copus: FAILED (the bundle lacks cache/ or parallel-tiny-gpu.ron: rebuild it)"
        status=1
        continue
      fi
      steps=()
      [ "$cpu" = 1 ] && steps=(--max-steps 40)
      back="$PWD"
      cd "$out/copus"
      export COPUS_CACHE="$out/copus/cache"
      part "$backend-copus" 80 "$bin" run recipe.ron ${steps[@]+"${steps[@]}"}
      unset COPUS_CACHE
      cd "$back"
      [ -f "$out/copus/runs/parallel-tiny-gpu/summary.md" ] && cat "$out/copus/runs/parallel-tiny-gpu/summary.md" \
        || { say "$backend-copus: FAILED (no summary.md)"; status=1; }
      # A live layout change between the ranks on the device keeps its pieces there: the step
      # after it (whose metrics count the change's bytes) moves at most 1 MiB of `state` through
      # host memory (the counts of differing elements it reads back). Steps after a checkpoint
      # (every 100) also count the checkpoint's reads and are left out.
      if ! python3 - "$out/copus/runs/parallel-tiny-gpu" <<'PY'
import csv, json, sys
run = sys.argv[1]
try:
    state = {}
    for line in open(f"{run}/metrics.jsonl"):
        r = json.loads(line)
        if "metrics" in r and "host_traffic" in r:
            state[r["metrics"]["step"]] = r["host_traffic"]["state"]
    moved = []
    for row in csv.DictReader(open(f"{run}/reconfigurations.csv")):
        s = int(row["step"])
        if row["layout_changed"] == "true" and row["live"] == "true" and s % 100 != 0 and s + 1 in state:
            moved.append((s, state[s + 1]))
except (OSError, KeyError, ValueError) as e:
    sys.exit(f"the run's metrics.jsonl or reconfigurations.csv could not be read: {e!r}")
print("state bytes through host memory of each live layout change (after step: bytes):",
      ", ".join(f"{s}: {b}" for s, b in moved) or "none")
if any(b > 1 << 20 for _, b in moved):
    sys.exit("a live layout change staged more than 1 MiB of state in host memory")
PY
      then
        say "$backend-copus: FAILED (see the line above)"
        status=1
      fi
      ;;
  esac
done
[ "$status" = 0 ] || fail "see above; logs in $out"
say "done; logs in $out"
