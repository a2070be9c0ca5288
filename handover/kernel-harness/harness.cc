// The lean upsert kernel's body (jaxres_lean_upsert without XLA) over the arrays dump.py wrote, for
// callgrind: see build.sh. Mirrors `Upsert` in storages/lean/kernels.cc; keep the two in step.
#include <chrono>

#include "dumped.h"

using namespace jaxres;
using namespace jaxres::lean;

__attribute__((noinline)) void RunUpsert(Writable& t, const uint32_t* words, int64_t n, int64_t capacity,
                                         int64_t size, bool* found, int32_t* slot, int32_t* first, bool* admitted) {
  std::vector<uint32_t> hash(n);
  LocateRows<2>(t.View(), words, 0, n, found, slot, hash.data());
  std::unique_ptr<bool[]> is_new(new bool[n]);
  for (int64_t i = 0; i < n; ++i) is_new[i] = !found[i];
  OwnerPerKey(words, n, t.num_words, is_new.get(), false, first);
  const int64_t room = std::max<int64_t>(capacity - size, 0);
  std::vector<char> head(n);
  std::vector<int32_t> placed(n, 0);
  int64_t heads = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (is_new[i] && first[i] == i) head[i] = ++heads <= room;
  }
  Place(t, words, hash.data(), n, head, placed.data());
  for (int64_t i = 0; i < n; ++i) {
    admitted[i] = is_new[i] && head[first[i]];
    if (admitted[i]) slot[i] = placed[first[i]];
  }
}

int main(int argc, char** argv) {
  const int iters = argc > 1 ? atoi(argv[1]) : 20;
  const Dumped dumped;
  const int64_t n = dumped.n;
  std::unique_ptr<bool[]> found(new bool[n]), admitted(new bool[n]);
  std::vector<int32_t> slot(n), first(n);
  uint64_t check = 0;  // over every call's slots, flags and digests: any change of placement changes it
  double best = 1e9;
  for (int it = 0; it < iters; ++it) {
    auto digests = dumped.digests, keys = dumped.keys, overflow = dumped.overflow;
    Writable t{reinterpret_cast<uint8_t*>(digests.data()), keys.data(), overflow.data(), dumped.num_buckets,
               dumped.bucket_size, dumped.num_words};
    const auto start = std::chrono::steady_clock::now();
    RunUpsert(t, dumped.words.data(), n, dumped.capacity, dumped.size, found.get(), slot.data(), first.data(),
              admitted.get());
    best = std::min(best, std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
    for (int64_t i = 0; i < n; ++i) check = check * 31 + slot[i] + 7 * admitted[i] + 3 * found[i];
    for (auto x : digests) check = check * 31 + x;
  }
  printf("check %lx best %.1f us\n", static_cast<unsigned long>(check), best);
}
