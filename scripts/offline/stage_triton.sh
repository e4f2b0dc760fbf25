#!/usr/bin/env bash
# Build .stage/t39.tar.xz: a second Triton (TRITON_VERSION, default 3.9.0) for a GPU host without network
# (python 3.12), trimmed to fit one 64 MiB carry (~57 MB), to time or test the kernels under it beside the
# image's Triton 3.6. Dropped: the AMD codegen library, CUPTI, proton, the legacy ptxas (sm_90 builds with
# ptxas-blackwell, kept; `ptxas` links to it). On the GPU host, with the archive carried:
#   mkdir -p $HOME/t39 && tar -xJf .stage/t39.tar.xz -C $HOME/t39
#   source scripts/offline/device_env.sh && export PYTHONPATH=$HOME/t39:$PYTHONPATH   # then the command
set -euo pipefail
VERSION=${TRITON_VERSION:-3.9.0}
WORK=${WORK:-${TMPDIR:-/tmp}/stage_triton}
ROOT=$(git rev-parse --show-toplevel)
rm -rf "$WORK/site"; mkdir -p "$WORK/whl" "$WORK/site" "$ROOT/.stage"
python3 -m pip download -q "triton==$VERSION" --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 -d "$WORK/whl"
python3 - "$WORK/whl" "$WORK/site" "$VERSION" <<'PY'
import os, sys, zipfile
whl_dir, site, version = sys.argv[1:]
wheel = next(f for f in os.listdir(whl_dir) if f.startswith(f"triton-{version}-"))
drop = ("triton/backends/nvidia/lib/cupti", "triton/instrumentation/", "triton/_C/libproton.so", "triton/profiler/",
        "triton/backends/nvidia/bin/ptxas")
with zipfile.ZipFile(os.path.join(whl_dir, wheel)) as z:
    for name in z.namelist():
        keep_amd = not (name.startswith("triton/backends/amd/") and name.endswith(".so"))
        if keep_amd and (not name.startswith(drop) or name.endswith("ptxas-blackwell")):
            z.extract(name, site)
PY
chmod +x "$WORK"/site/triton/backends/nvidia/bin/*
ln -sf ptxas-blackwell "$WORK/site/triton/backends/nvidia/bin/ptxas"
strip --strip-unneeded "$WORK/site/triton/_C/libtriton.so"
( cd "$WORK/site" && tar --sort=name --owner=0 --group=0 -cf - . ) | xz -9 -T0 > "$ROOT/.stage/t39.tar.xz"
ls -la "$ROOT/.stage/t39.tar.xz"
