# source scripts/offline/device_env.sh — on a GPU host without network, from the repo root.
# epirl is not pip-installed there (no network, no build isolation): build a package tree of symlinks that
# maps epirl.kernels/rewards/eval onto the top-level folders (as setup.py does), put it first on
# PYTHONPATH, install carried wheels (.whl/: math-verify and its parser) into /tmp/site, and source the
# staged vLLM environment ($HOME/vllm-env.sh) when present.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 WANDB_MODE=disabled
ROOT=$(pwd)
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/math_verify ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || true
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
[ -f "$HOME/vllm-env.sh" ] && source "$HOME/vllm-env.sh"
# one tree per shell: two jobs started side by side (one per GPU) must not delete each other's imports
PKG_TREE=/tmp/epirl_pkg_$$; rm -rf $PKG_TREE; mkdir -p $PKG_TREE/epirl
for f in "$ROOT"/epirl/*; do ln -s "$f" $PKG_TREE/epirl/; done
for top in kernels rewards eval; do ln -s "$ROOT/$top" $PKG_TREE/epirl/$top; done
export PYTHONPATH=$PKG_TREE${PYTHONPATH:+:$PYTHONPATH}
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
