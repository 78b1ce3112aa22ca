#!/usr/bin/env bash
# Bring a newer Triton to the GPU machine (its image: Python 3.12, torch 2.11 with triton 3.6.0,
# CUDA 13.0's ptxas, no network; a `run` call carries at most 64 MiB): the wheel stripped of
# what the image has or the H200 never uses (the CUDA tools in backends/nvidia/bin, the CUPTI
# copies behind the profiler, the AMD backend's device libraries), packed as .tar.xz and split
# into parts of at most 60 MiB, one per ignored folder .ext1/, .ext2/, ... (carry one folder per
# call while the machine stays warm: an ignored path not named in `carry` stays there).
#
#   here:    scripts/pack_triton.sh pack 3.9.0 [WHEEL]   # pip download, or a cp312 WHEEL file
#   there:   scripts/pack_triton.sh unpack /tmp/triton39  # after the last part has arrived
#            eval "$(scripts/pack_triton.sh env /tmp/triton39)"   # PYTHONPATH and tool paths
#
# `env` puts the unpacked Triton ahead of the image's (PYTHONPATH) and points Triton at the
# image's CUDA tools, for sm_90 too (Triton 3.9 reads TRITON_PTXAS_BLACKWELL_PATH there; it
# then writes the PTX version that ptxas accepts). Check first, in one call, that it imports
# beside the image's torch: python -c "import torch, triton; print(torch.__version__,
# triton.__version__)", and that scripts/compile_sm90.py --cases plain-bf16 compiles.
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { echo "pack_triton.sh: error: $1 (pack VERSION [WHEEL] | unpack DIR | env DIR)" >&2; exit 2; }
PART=60m

case "${1:-}" in
pack)
  version=${2:-}; [[ $version =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || usage "pack needs a version such as 3.9.0"
  work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
  wheel=${3:-}
  if [[ -z $wheel ]]; then
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
      --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
      -d "$work" "triton==$version"
    wheel=$(ls "$work"/triton-"$version"-*.whl)
  fi
  [[ -f $wheel && $(basename "$wheel") == triton-"$version"-* ]] || usage "no triton $version wheel: $wheel"
  mkdir "$work/site" && python3 -m zipfile -e "$wheel" "$work/site"
  rm -rf "$work"/site/triton/backends/nvidia/bin "$work"/site/triton/backends/nvidia/lib/cupti* \
    "$work"/site/triton/backends/amd/lib
  tar -C "$work/site" -cf - . | xz -6 -T0 > "$work/triton.tar.xz"
  rm -rf .ext[0-9]*/
  (cd "$work" && split -b "$PART" -d -a 1 triton.tar.xz part.)
  n=0
  for part in "$work"/part.*; do
    n=$((n + 1)); mkdir ".ext$n"; mv "$part" ".ext$n/"
  done
  (cd "$work" && sha256sum triton.tar.xz) | sed 's| .*| triton.tar.xz|' > .ext1/SHA256
  echo "triton $version: $n part(s) in .ext1 .. .ext$n ($(du -h "$work/triton.tar.xz" | cut -f1) packed); carry one per call"
  ;;
unpack)
  dest=${2:-}; [[ -n $dest ]] || usage "unpack needs a destination folder"
  ls -d .ext[0-9]*/ > /dev/null 2>&1 || usage "no .ext*/ parts here"
  cat $(ls .ext[0-9]*/part.* | sort -t. -k3n) > /tmp/triton.tar.xz
  (cd /tmp && sha256sum -c "$OLDPWD/.ext1/SHA256") || { echo "pack_triton.sh: parts incomplete" >&2; exit 1; }
  mkdir -p "$dest" && tar -C "$dest" -xJf /tmp/triton.tar.xz && rm /tmp/triton.tar.xz
  ls -d "$dest"/triton-*.dist-info
  ;;
env)
  dest=${2:-}; [[ -d $dest/triton ]] || usage "env needs an unpacked folder (unpack first)"
  bin=$(dirname "$(command -v ptxas || echo /usr/local/cuda/bin/ptxas)")
  echo "export PYTHONPATH=$dest\${PYTHONPATH:+:\$PYTHONPATH}"
  for tool in ptxas ptxas_blackwell cuobjdump nvdisasm; do
    echo "export TRITON_${tool^^}_PATH=$bin/${tool%_blackwell}"
  done
  ;;
*) usage "unknown command '${1:-}'" ;;
esac
