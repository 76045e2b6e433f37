#!/bin/bash
# Pack a Triton wheel for the GPU machine (which has Triton 3.6 and no internet): the cp312
# wheel (the machine's Python; libtriton.so is built per Python ABI, and another ABI's
# build segfaults at `import triton`), libtriton.so stripped, and what a GPU run does not
# need left out (proton, cupti, the AMD backend's libraries, the MLIR headers, nvdisasm, the
# ptxas this version does not use for sm_90). The result, under a
# git-ignored .tXY/ folder (about 50 MB), travels in the run's carry list:
#   bash benchmarks/pack_triton.sh 3.8.0        # -> .t38/triton38.tar.xz
#   run: TRITON_NEXT_TAR=.t38 bash benchmarks/gpu_session.sh triton-next   (carry .t38)
# docs/performance/method.md#another-triton
set -eu
V=${1:?usage: pack_triton.sh VERSION, e.g. 3.8.0}
tag=$(echo "$V" | cut -d. -f1,2 | tr -d .)
dest=${2:-.t$tag}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_27_x86_64 \
  "triton==$V" -d "$work" 2>&1 | grep -v -i 'is ignored' || true
mkdir "$work/u"; (cd "$work/u" && unzip -q "$work"/triton-"$V"-cp312-*.whl)
t=$work/u/triton
strip --strip-unneeded "$t/_C/libtriton.so"
rm -rf "$t/_C/libproton.so" "$t/profiler" "$t/backends/amd/lib" \
       "$t/backends/nvidia/lib/cupti" "$t/backends/nvidia/lib/cupti-blackwell" \
       "$t/backends/nvidia/bin/nvdisasm"
# the ptxas that this version calls for sm_90 (3.9: ptxas-blackwell; before: ptxas)
if grep -q 'ptxas_blackwell if arch >= 100' "$t/backends/nvidia/compiler.py"; then
  rm -f "$t/backends/nvidia/bin/ptxas-blackwell"
else
  rm -f "$t/backends/nvidia/bin/ptxas"
fi
find "$work/u" -name include -path '*mlir*' -prune -exec rm -rf {} + 2>/dev/null || true
mkdir -p "$dest"
tar -C "$work/u" -cf - . | xz -T0 -9 > "$dest/triton$tag.tar.xz"
ls -la "$dest/triton$tag.tar.xz"
