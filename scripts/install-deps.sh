#!/usr/bin/env bash
# Installs the Debian packages fivefold needs, when missing. Fast when all are present.
# As root it runs apt-get; otherwise it prints the exact command and stops.
set -euo pipefail

packages=(openmpi-bin libopenmpi-dev doctest-dev libboost-context-dev
          nlohmann-json3-dev zlib1g-dev python3-matplotlib python3-numpy)
# PyTorch regenerates the golden data (make reference), is the reference make bench times
# lesson 08's training step against, and loads a lesson 08 checkpoint in make test
# (tests/reference/load_checkpoint.py); Chromium only to render the slides to
# PDF and PNG (make slides), OpenBLAS only as the reference make bench times the cpu matmul
# against (linked into the bench alone: the lessons stay BLAS-free).
if [ "${FIVEFOLD_WITH_TORCH:-0}" = 1 ]; then packages+=(python3-torch); fi
# pytest runs the lesson tests (tests/lessons/, make test); xdist runs them in parallel by hand
if [ "${FIVEFOLD_WITH_TESTS:-0}" = 1 ]; then packages+=(python3-pytest python3-pytest-xdist); fi
if [ "${FIVEFOLD_WITH_CHROMIUM:-0}" = 1 ]; then packages+=(chromium); fi
if [ "${FIVEFOLD_WITH_OPENBLAS:-0}" = 1 ]; then packages+=(libopenblas-dev); fi

# one dpkg-query for all of them (a no-op make runs this); it exits 1 when one was never installed
installed=" $({ dpkg-query -W -f='${Package}:${Status}\n' "${packages[@]}" 2>/dev/null || true; } |
              sed -n 's/^\([^:]*\):install ok installed$/\1/p' | tr '\n' ' ') "
missing=()
for p in "${packages[@]}"; do
  [[ $installed == *" $p "* ]] || missing+=("$p")
done

# Marp (slides/package.json, versions pinned by slides/package-lock.json) from the npm
# registry, into slides/node_modules: installed again only when the lock file changed.
slides_deps() {
  local stamp=slides/node_modules/.fivefold-lock
  if [ -f "$stamp" ] && cmp -s slides/package-lock.json "$stamp"; then return 0; fi
  if ! command -v npm >/dev/null; then
    echo "error: npm not found: the slides need Node.js and npm (Debian: apt-get install nodejs npm)" >&2
    exit 1
  fi
  echo "installing: slides/node_modules (npm ci: @marp-team/marp-cli, puppeteer-core)"
  (cd slides && npm ci --no-audit --no-fund --loglevel=error >/dev/null) ||
    { echo "error: npm ci in slides/ failed (the npm registry must be reachable)" >&2; exit 1; }
  cp slides/package-lock.json "$stamp"
}
cd "$(dirname "$0")/.."
# the decks only (make test checks them, make slides builds them); make and make lessons need none
if [ "${FIVEFOLD_WITH_SLIDES:-0}" = 1 ]; then slides_deps; fi
[ ${#missing[@]} -eq 0 ] && exit 0

cmd="apt-get install -y --no-install-recommends ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
  echo "error: missing packages: ${missing[*]}" >&2
  echo "install them with:  sudo apt-get update && sudo $cmd" >&2
  exit 1
fi
echo "installing: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
$cmd -qq >/dev/null
echo "installed: ${missing[*]}"
