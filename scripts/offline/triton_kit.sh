#!/usr/bin/env bash
# triton_kit.sh -- stage Triton 3.7.1 + flash-linear-attention 0.6.0 for an H200 host without network.
#
# Why: the device image has triton 3.6 and no fla. fla 0.6's gated chunk backward refuses Hopper below
# Triton 3.7.1 (fla/ops/common/chunk_o.py: "Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect
# results"), so the trainer falls back to transformers' torch GDN (>10x slower). This kit carries a trimmed
# triton 3.7.1 + fla, unpacked on the device to $HOME/triton37-site and put FIRST on PYTHONPATH so it shadows
# the image's triton 3.6 (torch 2.11 and vLLM 0.26 then run on 3.7.1 too: gpu_fla_check.py checks).
# Built like the vLLM kit: run on a machine with pip access, from the repo root. Output (git-ignored):
#   .stage/triton37.partNN        xz tar of the site tree, split in <= CHUNK_MB MiB
#   .stage/SHA256SUMS-triton37    checksums of the parts (not SHA256SUMS: that name is the vLLM kit's)
#   .stage/install-triton37.sh    runs ON the device: checks sums, unpacks to $HOME/triton37-site once
#   .stage/env-triton37.sh        installed as $HOME/env-triton37.sh; `source` it after ~/vllm-env.sh
# and prints the device call sequence, packed together with the vLLM kit's parts when .stage/ has them.
#
# Knobs (env): CHUNK_MB (58), XZ_LEVEL (9; 6 is ~2x faster on 2 cores, a few MB bigger), CARRY_MB (60: what one
# call may carry, leaving room under the 64 MiB limit for the ~2 MB working tree and .whl),
# TRITON_WHEEL / FLA_WHEEL / FLA_CORE_WHEEL (local wheels: skip the download), WORK ($TMPDIR/triton_kit).
# `bash scripts/offline/triton_kit.sh --print-trim` prints the trim list (path  # why) and exits (tests read it).
# `--plan` only prints the call sequence for the parts already in .stage/; `--device-scripts` only writes
# install-triton37.sh + env-triton37.sh (tests run them on a fake payload). STAGE overrides .stage/.
set -euo pipefail

CHUNK_MB=${CHUNK_MB:-58}
CARRY_MB=${CARRY_MB:-60}
XZ_LEVEL=${XZ_LEVEL:-9}
WORK=${WORK:-${TMPDIR:-/tmp}/triton_kit}
PIP=${PIP:-"python3 -m pip"}
ROOT=$(git rev-parse --show-toplevel 2>/dev/null || pwd)
STAGE=${STAGE:-$ROOT/.stage}  # override: tests plan/install from a scratch folder
PINS=(triton==3.7.1 flash-linear-attention==0.6.0 fla-core==0.6.0)
# No other dependency travels: fla-core needs einops (in the device image, KINDS.md's package list),
# flash-linear-attention needs transformers>=5.6.2,<6 (image: 5.17), triton 3.7.1 needs nothing at run time.

# Paths (relative to the site tree) removed before packing. Kept on purpose: triton/_C/libtriton.so (the
# compiler), backends/nvidia/bin/ptxas (sm_90 codegen), nvdisasm + cuobjdump (knobs.nvidia resolves them;
# small), backends/nvidia/include + lib/libdevice.10.bc (triton builds its launcher from driver.c at run time
# and links libdevice), backends/amd (its Python files: the `triton.backends` entry points import the amd
# backend at `import triton`, so removing it breaks the import; 2.7 MB raw), triton/profiler/*.py (tiny).
trim_list() {
  cat <<'EOF'
triton/backends/nvidia/lib/cupti  # CUPTI + nvperf, 128 MB raw: only proton (triton.profiler) loads them; torch's profiler uses the image's nvidia-cuda-cupti
triton/_C/libproton.so  # proton profiler extension: loaded only by `import triton.profiler` (inductor only with config.triton.proton_profiling)
triton/backends/nvidia/bin/ptxas-blackwell  # backends/nvidia/compiler.py picks it only for arch >= 100; the H200 is sm_90
triton/instrumentation  # GPU instrumentation *test* library (libGPUInstrumentationTestLib.so), used by triton's own tests
triton/plugins  # example MLIR dialect/pass plugins; libtriton.so loads plugins only from TRITON_PLUGIN_PATHS
triton/FileCheck  # LLVM FileCheck binary for triton's lit-style tests (triton/_filecheck.py)
bin  # console scripts (proton, proton-viewer) that pip --target writes; nothing runs them
EOF
}

if [ "${1:-}" = --print-trim ]; then trim_list; exit 0; fi

# Pack the staged parts (vLLM kit's and this kit's) into as few calls as the carry limit allows; the call
# with the most room left also carries the small files and runs both installers + the command.
print_calls() {
  python3 - "$STAGE" "$CARRY_MB" <<'EOF'
import os, sys
stage, cap = sys.argv[1], float(sys.argv[2]) * 2**20
parts = sorted((f for f in (os.listdir(stage) if os.path.isdir(stage) else []) if ".part" in f), key=lambda f: -os.path.getsize(os.path.join(stage, f)))
small = [f for f in ("SHA256SUMS", "install.sh", "env.sh", "SHA256SUMS-triton37", "install-triton37.sh",
                     "env-triton37.sh") if os.path.exists(os.path.join(stage, f))]
calls = []  # first-fit decreasing
for p in parts:
    size = os.path.getsize(os.path.join(stage, p))
    fit = next((c for c in calls if c[0] + size <= cap), None)
    if fit is None:
        calls.append(fit := [0, []])
    fit[0] += size; fit[1].append(p)
if not calls:
    sys.exit("no .partNN files in .stage/: build the kits first")
calls.sort(key=lambda c: -c[0])  # the emptiest call goes last: it also carries the small files
calls[-1][1].extend(small)
if len(calls[-1][1]) > 7:
    print("warning: the last call carries > 7 paths (8 at most, .whl included); move a part to an earlier call")
vllm = "bash .stage/install.sh && source ~/vllm-env.sh && " if "install.sh" in small else ""
for i, (size, paths) in enumerate(calls, 1):
    carry = ", ".join(f'".stage/{p}"' for p in paths)
    cp = "mkdir -p $HOME/stage && cp " + " ".join(f".stage/{p}" for p in paths if ".part" in p) + " $HOME/stage/"
    cmd = cp if i < len(calls) else (f"{cp} && {vllm}bash .stage/install-triton37.sh && "
                                     "source ~/env-triton37.sh && YOUR_COMMAND")
    print(f"call {i} ({size / 2**20:.1f} MiB): carry=[{carry}]\n  command: {cmd}")
print("(a call that needs math-verify also carries \".whl\" (0.4 MB) -- 8 carry paths at most per call)")
EOF
  echo "later calls while warm: source scripts/offline/device_env.sh && YOUR_COMMAND   (device_env.sh sources"
  echo "  ~/vllm-env.sh; gpu_main_recipe.sh also sources ~/env-triton37.sh; else: source ~/env-triton37.sh after it)"
  echo "first command after staging: bash -c 'source scripts/offline/device_env.sh && source ~/env-triton37.sh" \
    "&& python3 -P scripts/offline/gpu_fla_check.py'"
}
if [ "${1:-}" = --plan ]; then print_calls; exit 0; fi

# The two files that run on the device (written by the build; `--device-scripts` writes only these, for tests).
write_device_scripts() {
  mkdir -p "$STAGE"
cat > "$STAGE/install-triton37.sh" <<'EOS'
#!/usr/bin/env bash
# Runs ON the device (repo root = cwd). Parts carried by earlier calls were copied to $HOME/stage (ignored
# files do not stay in the repo copy between calls). Checks sums and unpacks to $HOME/triton37-site once:
# into a temporary folder renamed at the end, so an interrupted unpack is redone, never half-used.
set -e
mkdir -p $HOME/stage
cp .stage/triton37.part* .stage/SHA256SUMS-triton37 $HOME/stage/ 2>/dev/null || true
if [ ! -f $HOME/triton37-site/.complete ]; then
  t0=$(date +%s)
  (cd $HOME/stage && sha256sum -c --quiet SHA256SUMS-triton37)
  rm -rf $HOME/triton37-site.tmp $HOME/triton37-site; mkdir -p $HOME/triton37-site.tmp
  cat $HOME/stage/triton37.part* | xz -dc | tar -x -C $HOME/triton37-site.tmp
  touch $HOME/triton37-site.tmp/.complete && mv $HOME/triton37-site.tmp $HOME/triton37-site
  echo "triton 3.7.1 + fla 0.6.0 unpacked to $HOME/triton37-site in $(( $(date +%s) - t0 )) s"
fi
cp .stage/env-triton37.sh "$HOME/env-triton37.sh" 2>/dev/null || true
EOS
cat > "$STAGE/env-triton37.sh" <<'EOS'
# source ~/env-triton37.sh on the device, AFTER ~/vllm-env.sh (both prepend to PYTHONPATH; the last one wins).
# Separate caches: Triton's cache key has the compiler version, but inductor's and vLLM's compile caches hold
# Triton-built code under keys that may not; a 3.6 artefact must never be loaded by 3.7.1 or the reverse.
case ":${PYTHONPATH:-}:" in *":$HOME/triton37-site:"*) ;;
  *) export PYTHONPATH=$HOME/triton37-site${PYTHONPATH:+:$PYTHONPATH} ;; esac
export TRITON_CACHE_DIR=$HOME/.cache/triton37 TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor_triton37 \
  VLLM_CACHE_ROOT=$HOME/.cache/vllm-triton37
EOS
}
if [ "${1:-}" = --device-scripts ]; then write_device_scripts; exit 0; fi

PLATS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
       --platform manylinux2014_x86_64 --platform any)
mkdir -p "$WORK/whl" "$STAGE"
grep -qxF '/.stage/' "$ROOT/.git/info/exclude" 2>/dev/null || {
  mkdir -p "$ROOT/.git/info"; echo '/.stage/' >> "$ROOT/.git/info/exclude"; } || true

# 1. wheels (cp312 manylinux: the device's python3.12, not this machine's)
for w in "${TRITON_WHEEL:-}" "${FLA_WHEEL:-}" "${FLA_CORE_WHEEL:-}"; do [ -n "$w" ] && cp -n "$w" "$WORK/whl/"; done
for pin in "${PINS[@]}"; do
  n=$(echo "${pin%%==*}" | tr '-' '_'); v=${pin#*==}
  ls "$WORK"/whl/"$n"-"$v"-*.whl >/dev/null 2>&1 || $PIP download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${PLATS[@]}" -d "$WORK/whl" "$pin"
done
WHEELS=()
for pin in "${PINS[@]}"; do
  n=$(echo "${pin%%==*}" | tr '-' '_'); v=${pin#*==}; WHEELS+=("$(ls "$WORK"/whl/"$n"-"$v"-*.whl | head -1)")
done

# 2. site tree: pip --target keeps the wheels' exec bits (ptxas must stay executable) and dist-info, whose
# entry points triton uses to find its backends and whose versions importlib.metadata reports (3.7.1 shadows
# the image's 3.6 dist-info because PYTHONPATH comes before site-packages).
SITE="$WORK/site"; rm -rf "$SITE"; mkdir -p "$SITE"
$PIP install -q --no-index --no-deps --no-compile --target "$SITE" \
  --python-version 3.12 --implementation cp "${PLATS[@]}" --only-binary=:all: "${WHEELS[@]}"
trim_list | while read -r path _; do
  [ -e "$SITE/$path" ] || { echo "trim: $path is not in the tree (a new wheel layout?)" >&2; exit 1; }
  rm -rf "${SITE:?}/$path"
done
find "$SITE" -name __pycache__ -type d -prune -exec rm -rf {} +
# libtriton.so ships "with debug_info, not stripped": 462 MB, of which ~240 MB are .debug_* sections that are
# never loaded (DWARF for debuggers). --strip-debug keeps .symtab (LLVM crash backtraces stay symbolized) and
# every loaded segment, so the code is byte-identical; xz payload 77 MB -> 39 MB.
if command -v strip >/dev/null; then strip --strip-debug "$SITE/triton/_C/libtriton.so"
else echo "warning: no strip (binutils): libtriton.so travels with its debug info (+38 MB xz)" >&2; fi
for b in ptxas nvdisasm cuobjdump; do chmod +x "$SITE/triton/backends/nvidia/bin/$b"; done
"$SITE/triton/backends/nvidia/bin/ptxas" --version | tail -1  # a broken binary shows here, not on the device

# 3. one xz tar, split into chunks
rm -f "$STAGE"/triton37.part* "$STAGE/SHA256SUMS-triton37"
t0=$(date +%s)
( cd "$SITE" && tar --sort=name --owner=0 --group=0 -cf - . ) | xz -"$XZ_LEVEL" -T0 > "$WORK/triton37.tar.xz"
echo "xz -$XZ_LEVEL took $(( $(date +%s) - t0 )) s on $(nproc) cores"
split -b "${CHUNK_MB}M" -d -a 2 "$WORK/triton37.tar.xz" "$STAGE/triton37.part"
( cd "$STAGE" && sha256sum triton37.part* > SHA256SUMS-triton37 )

write_device_scripts

echo "== wheels"; ls -l "${WHEELS[@]}" | awk '{print $5, $9}'
echo "== site tree: $(du -sh "$SITE" | cut -f1) raw, payload $(stat -c %s "$WORK/triton37.tar.xz") bytes xz"
ls -l "$STAGE"/triton37.part*
echo
echo "== device calls (each within 30 s of the previous one's end, or the machine is given back: start over)"
print_calls
