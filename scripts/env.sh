#!/usr/bin/env bash
# Build (once) and print the path of one of dualop's two test environments.
#
#   scripts/env.sh latest   torch 2.13 (CPU), jax 0.10.2, triton 3.9
#   scripts/env.sh xla      torch 2.9 + torch_xla 2.9, jax 0.7.1, flax, torchax, triton 3.5
#
# Environments live outside the checkout (DUALOP_ENV_ROOT, default ~/.cache/dualop/envs) and are
# keyed by a hash of pyproject.toml and the constraint file, so a fresh clone reuses a built one and
# a change of dependencies builds a new one. The project itself is (re)installed editable each time,
# so the environment always runs the checkout that called this script.
set -euo pipefail

name="${1:?usage: scripts/env.sh latest|xla}"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
constraints="$repo/constraints/$name.txt"
[ -f "$constraints" ] || { echo "env.sh: no constraint file $constraints" >&2; exit 2; }
case "$name" in
  latest) extras="torch,jax,triton,dev" ;;
  xla)    extras="torch,jax,triton,xla,dev" ;;
  *) echo "env.sh: unknown environment '$name' (expected latest or xla)" >&2; exit 2 ;;
esac

python="${DUALOP_PYTHON:-python3}"
root="${DUALOP_ENV_ROOT:-$HOME/.cache/dualop/envs}"
key="$(cat "$repo/pyproject.toml" "$constraints" | sha256sum | cut -c1-12)"
env="$root/$name-$key"

if [ ! -f "$env/.complete" ]; then
  echo "env.sh: building the '$name' environment in $env (first run only; the xla one is ~7.6 GB)" >&2
  rm -rf "$env"
  mkdir -p "$root"
  "$python" -m venv "$env"
  "$env/bin/python" -m pip install --quiet --upgrade "pip>=24" "setuptools>=69" wheel >&2
  "$env/bin/python" -m pip install --quiet -c "$constraints" -e "$repo[$extras]" >&2
  touch "$env/.complete"
fi
# Point the environment at this checkout (cheap; no dependency resolution).
"$env/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e "$repo" >&2
echo "$env"
