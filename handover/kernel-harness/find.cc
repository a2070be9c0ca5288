// LookupRows (the lean `find` kernel, 16-byte rows, 2-word keys) over 4,096 present keys of the arrays
// dump.py wrote, for callgrind: see build.sh.
#include "dumped.h"

using namespace jaxres;
using namespace jaxres::lean;

__attribute__((noinline)) void RunFind(const Slots& view, const uint32_t* w, int64_t n,
                                       const std::vector<Column>& columns, bool* hit) {
  LookupRows<16, 2>(view, w, 0, n, columns, hit);
}

int main(int argc, char** argv) {
  const int iters = argc > 1 ? atoi(argv[1]) : 20;
  Dumped t;
  const int64_t n = t.n, half = n / 2 * t.num_words;
  std::vector<uint32_t> present(t.words.begin(), t.words.begin() + half);  // the present half, twice
  present.insert(present.end(), t.words.begin(), t.words.begin() + half);
  std::vector<float> values(t.num_slots * 4, 1.0f), out(n * 4), fallback(4, -1.0f);
  std::vector<Column> columns{{reinterpret_cast<const char*>(values.data()),
                               reinterpret_cast<const char*>(fallback.data()), reinterpret_cast<char*>(out.data()), 16, 0}};
  std::unique_ptr<bool[]> hit(new bool[n]);
  const Slots view{reinterpret_cast<const uint8_t*>(t.digests.data()), t.keys.data(), t.overflow.data(),
                   t.num_buckets, t.bucket_size, t.num_words};
  int64_t hits = 0;
  for (int it = 0; it < iters; ++it) {
    RunFind(view, present.data(), n, columns, hit.get());
    for (int64_t i = 0; i < n; ++i) hits += hit[i];
  }
  printf("hits %ld of %ld a call\n", hits / iters, n);
}
