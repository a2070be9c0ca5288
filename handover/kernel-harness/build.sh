#!/usr/bin/env bash
# Instructions a key of the lean kernels, under callgrind, without JAX (about a minute):
#   cd handover/kernel-harness && ../../.venv/bin/python dump.py [capacity] && bash build.sh
# dump.py writes a half-full lean table of int64 keys and a batch of 4,096 keys (half present) here;
# harness.cc times and counts the upsert kernel's body (LocateRows, OwnerPerKey, Place) over them,
# find.cc LookupRows over 4,096 present keys. The check value printed by `harness N` changes with N
# and with any change of placement: compare it before and after a change at the same N.
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$(cd ../.. && pwd)
J=$("$ROOT/.venv/bin/python" -c "import jaxlib, os; print(os.path.join(os.path.dirname(jaxlib.__file__), 'include'))")
GEN=$(ls -d "$ROOT"/build/temp.*/jaxres_generated | head -1)  # from `python setup.py build_ext --inplace`
for main in harness find; do
  g++ -O3 -std=c++17 -g -I . -I "$ROOT/jaxres/_core" -I "$ROOT/jaxres/_core/kernels" -I "$GEN" -isystem "$J" -o "$main" "$main.cc"
done
./harness 200
valgrind --tool=callgrind --callgrind-out-file=upsert.out ./harness 5 2>&1 | tail -1
callgrind_annotate --inclusive=yes upsert.out | grep -E "RunUpsert|Place|LocateRows" | head -3
valgrind --tool=callgrind --callgrind-out-file=find.out ./find 20 2>&1 | tail -1
callgrind_annotate --inclusive=yes find.out | grep -E "RunFind" | head -1
echo "instructions a key: the inclusive counts above / (calls x 4,096): harness 5 calls, find 20"
