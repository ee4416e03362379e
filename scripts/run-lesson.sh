#!/usr/bin/env bash
# make run L=01 NP=4 ARGS="..." — runs one lesson under mpirun.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
L=$1; NP=$2; shift 2
dir=$(lesson_dir "$L")
if [ -z "$dir" ]; then
  echo "error: no lesson $L (available: $(ls lessons | cut -c1-2 | tr '\n' ' '))" >&2; exit 2
fi
NP=${NP:-$(lesson_np "$dir")}
bin=${FF_RUN_BIN:-$BUILD/bin/$(basename "$dir")}  # (make run EX=1: the student's copy)
# say exactly what runs ($MPIRUN comes from the Makefile: see MPIRUN there)
echo "+ $MPIRUN -np $NP $bin $*"
exec $MPIRUN -np "$NP" "$bin" "$@"
