#!/usr/bin/env bash
# mt under mpirun: one MPI rank per GPU (or CPU process). mt_dist.discover finds the rank, the
# world size and the local rank through mpi4py (pip install 'mt-dist[mpi]'), and rank 0
# broadcasts its address and a free port.
#   HOSTFILE=infra/launch/hostfile.example NP=16 infra/launch/mpirun.sh --tp 8 --pp 2
set -euo pipefail
HOSTFILE=${HOSTFILE:-infra/launch/hostfile.example}
NP=${NP:-16}
# Open MPI; with MPICH use: mpiexec -f "$HOSTFILE" -n "$NP" -env OMP_NUM_THREADS 1 mt pretrain "$@"
exec mpirun --hostfile "$HOSTFILE" -np "$NP" --map-by ppr:8:node --bind-to none \
  -x OMP_NUM_THREADS=1 -x PATH -x LD_LIBRARY_PATH \
  mt pretrain "$@"
