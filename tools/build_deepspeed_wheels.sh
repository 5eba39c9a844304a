#!/usr/bin/env bash
# Puts into .whl/ (git-ignored, at the project root) what DeepSpeed 0.19.8 needs on the GPU machine
# and the machine lacks, for the deepspeed-offload contender of tools/bench_train.py
# (tools/bench_deepspeed.py). A benchmark peer only: never a dependency of the package.
#
#   usage (anywhere in the checkout):  bash tools/build_deepspeed_wheels.sh
#   then carry [".whl"] and start the GPU command with the install line this script prints.
#
# DeepSpeed is a source archive on PyPI. Its setup.py imports torch (to list its op builders and
# record torch's version) but needs nothing CUDA when DS_BUILD_OPS=0: no op is compiled here, the
# wheel is pure Python (py3-none-any), and the ops it uses (CPU Adam) are JIT-compiled with g++ and
# ninja on the GPU machine on first use. The other requirements of deepspeed that the GPU image
# already has (einops, msgpack, ninja, numpy, packaging, psutil, py-cpuinfo, torch, tqdm,
# nvidia-ml-py: /work/.library/device/KINDS.md's package list) are not carried. pydantic and its
# dependencies are pinned to the versions in .wheels/ (tools/device_wheels.sh, for wandb),
# so installing both wheelhouses never puts two versions of one package on the machine.
# Other wheels in .whl/ (flexgen, ...) are left alone.
set -euo pipefail
DS_VERSION=0.19.8
DEPS=(hjson==3.1.0 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0
      typing-inspection==0.4.5 typing-extensions==4.16.0)
PY=${PYTHON:-python3}

root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
cd "$root"
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
mkdir -p .whl

# One version of each package: drop other versions of ours (a second version stops the whole install).
wheel_name() { echo "$1" | tr 'A-Z-' 'a-z_'; }  # hjson==3.1.0 -> hjson, pydantic-core -> pydantic_core
for spec in "deepspeed==$DS_VERSION" "${DEPS[@]}"; do
  name=$(wheel_name "${spec%%==*}"); version=${spec##*==}
  for f in .whl/"$name"-*.whl; do
    [ -e "$f" ] || continue
    case "$(basename "$f")" in "$name-$version-"*) ;; *) echo "removing $f (not $spec)"; rm -f "$f" ;; esac
  done
done

tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

if ! ls .whl/deepspeed-"$DS_VERSION"-py3-none-any.whl >/dev/null 2>&1; then
  # A throwaway venv that sees this machine's torch (any version >= 2.0, CPU is enough) plus `wheel`.
  # (A virtual environment's python does not pass its own packages on: $PY's sys.path is added instead.)
  "$PY" -c "import torch" || { echo "torch must be importable by $PY to build deepspeed" >&2; exit 1; }
  "$PY" -m venv "$tmp/venv"
  "$PY" -c "import site, sys; print('\n'.join(p for p in sys.path if p.endswith('-packages')))" \
    > "$("$tmp/venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')/outer.pth"
  "$tmp/venv/bin/python" -c "import torch" || { echo "torch must be importable by $PY to build deepspeed" >&2; exit 1; }
  "$tmp/venv/bin/python" -c "import wheel" 2>/dev/null || "$tmp/venv/bin/python" -m pip install -q wheel
  "$tmp/venv/bin/python" -m pip download -q --no-deps --no-binary :all: -d "$tmp/sdist" "deepspeed==$DS_VERSION"
  DS_BUILD_OPS=0 "$tmp/venv/bin/python" -m pip wheel -q --no-deps --no-build-isolation --no-cache-dir \
    -w .whl "$tmp"/sdist/deepspeed-"$DS_VERSION".tar.gz
fi

python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${DEPS[@]}"

files=(".whl/deepspeed-$DS_VERSION-py3-none-any.whl")
for spec in "${DEPS[@]}"; do
  name=$(wheel_name "${spec%%==*}"); version=${spec##*==}
  f=$(ls .whl/"$name-$version"-*.whl | head -1); files+=("$f")
done
echo "deepspeed-offload wheels:"; du -ch "${files[@]}"
echo ".whl/ in all: $(du -sh .whl | cut -f1)"
# What a device call carries: tracked + untracked-not-ignored files, plus .whl (plus any other carried path).
tree_bytes=$(git ls-files -z -co --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
whl_bytes=$(du -sb .whl | cut -f1)
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
echo "working tree that travels: $(mib "$tree_bytes") + .whl $(mib "$whl_bytes") = $(mib $((tree_bytes + whl_bytes)))" \
     "(limit 64 MiB; add .wheels, $(mib "$(du -sb .wheels 2>/dev/null | cut -f1 || echo 0)"), if carried too)"
echo
echo "On the GPU machine (carry [\".whl\"]), first:"
echo "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir ${files[*]}"
