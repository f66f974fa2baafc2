#!/usr/bin/env bash
# Build an offline wheelhouse of the kvflow runtime dependencies that an air-gapped GPU
# machine lacks, for that machine's Python and platform (default: CPython 3.12, manylinux
# x86_64), then print the command that installs it there without any registry.
#
# The list below is what the GPU image ('cuda', Python 3.12 with torch 2.11, triton 3.6,
# transformers, numpy, tokenizers, jinja2, safetensors, tqdm, aiohttp, uvloop, anyio, h11,
# click, httpx, prometheus-client, pyyaml, requests, annotated-doc ...) does not have, or
# has too old: see docs/serving.md. Each wheel is fetched on its own (--no-deps), so
# nothing already on the machine is downloaded again.
#
# usage: scripts/build_wheelhouse.sh [-d DIR] [--python-version 3.12] [--arch x86_64]
#                                    [--with-kvflow] [EXTRA_PACKAGE==VERSION ...]
set -euo pipefail

DEST=wheelhouse
PYVER=3.12
ARCH=x86_64
WITH_KVFLOW=0
EXTRA=()
PYTHON=${PYTHON:-python3}

# package==version                    why it is needed there
PACKAGES=(
  "fastapi==0.165.0"                  # the HTTP server
  "starlette==1.10.0"                 # fastapi
  "uvicorn==0.54.0"                   # the ASGI server (uses the image's uvloop, h11, click)
  "pydantic==2.14.4"                  # fastapi and the API schemas
  "pydantic-core==2.50.5"             # pydantic (binary)
  "annotated-types==0.8.0"            # pydantic
  "typing-inspection==0.4.5"          # pydantic, fastapi
  "typing-extensions==4.16.0"         # pydantic needs >= 4.16, newer than the image's
  "opentelemetry-api==1.45.2"         # fastapi >= 0.160 imports it
  "msgspec==0.23.0"                   # typed IPC messages (binary)
  "pyzmq==27.3.0"                     # IPC sockets (binary, bundles libzmq)
  "gguf==0.19.0"                      # GGUF weights and metadata
  "xgrammar==0.2.9"                   # structured outputs: the grammar engine (binary)
  "apache-tvm-ffi==0.1.15.post2"      # xgrammar's FFI (binary)
)

while [[ $# -gt 0 ]]; do
  case "$1" in
    -d|--dest) DEST=$2; shift 2 ;;
    --python-version) PYVER=$2; shift 2 ;;
    --arch) ARCH=$2; shift 2 ;;
    --with-kvflow) WITH_KVFLOW=1; shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    -*) echo "unknown option $1" >&2; exit 2 ;;
    *) EXTRA+=("$1"); shift ;;
  esac
done

# pip matches manylinux_2_N tags exactly: offer every glibc from 2.17 to 2.39.
PLATFORMS=(--platform "manylinux2014_$ARCH" --platform "manylinux1_$ARCH")
for n in $(seq 17 39); do PLATFORMS+=(--platform "manylinux_2_${n}_$ARCH"); done

mkdir -p "$DEST"
echo "wheelhouse for CPython $PYVER on linux $ARCH -> $DEST"
for spec in "${PACKAGES[@]}" "${EXTRA[@]}"; do
  [[ -z "$spec" ]] && continue
  if ! "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
      --python-version "$PYVER" --implementation cp "${PLATFORMS[@]}" \
      --dest "$DEST" "$spec"; then
    echo "error: no wheel of $spec for CPython $PYVER on $ARCH" >&2
    exit 1
  fi
  echo "  $spec"
done

if [[ $WITH_KVFLOW == 1 ]]; then
  root=$(cd "$(dirname "$0")/.." && pwd)
  "$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation --wheel-dir "$DEST" "$root"
  echo "  kvflow (from $root)"
fi

printf '%s\n' "${PACKAGES[@]}" "${EXTRA[@]}" | sed '/^$/d' > "$DEST/requirements.txt"
count=$(ls "$DEST"/*.whl | wc -l)
size=$(du -sh "$DEST" | cut -f1)
cat <<EOF

$count wheels, $size in $DEST. On the air-gapped machine, from the folder that holds $DEST:

  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
      --target /tmp/site $DEST/*.whl && export PYTHONPATH=/tmp/site\${PYTHONPATH:+:\$PYTHONPATH}

(or, into that Python's own environment: python3 -m pip install --no-index --no-deps $DEST/*.whl)
then check:  python3 -c "import fastapi, uvicorn, pydantic, zmq, msgspec, gguf; print('ok')"
EOF
