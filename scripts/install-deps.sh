#!/usr/bin/env bash
# Installs the Debian packages fivefold needs, when missing. Fast when all are present.
# As root it runs apt-get; otherwise it prints the exact command and stops.
set -euo pipefail

packages=(openmpi-bin libopenmpi-dev doctest-dev libboost-context-dev
          python3-matplotlib python3-numpy)
# PyTorch is needed only to regenerate the golden data (make reference).
if [ "${FIVEFOLD_WITH_TORCH:-0}" = 1 ]; then packages+=(python3-torch); fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
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
