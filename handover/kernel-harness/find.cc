// LookupRows (the lean `find` kernel, 16-byte rows, 2-word keys) over 4,096 present keys of the arrays
// dump.py wrote, for callgrind: see build.sh.
#include "storages/lean/kernels.cc"
#include <cstdio>
#include <fstream>
#include <iterator>
std::vector<jaxres::Kernel>& jaxres::Kernels() { static std::vector<jaxres::Kernel> k; return k; }
template <typename T> std::vector<T> Load(const char* f) {
  std::ifstream in(f, std::ios::binary);
  std::vector<char> b((std::istreambuf_iterator<char>(in)), {});
  std::vector<T> v(b.size() / sizeof(T)); std::memcpy(v.data(), b.data(), b.size()); return v;
}
using namespace jaxres; using namespace jaxres::lean;
__attribute__((noinline)) void RunFind(const Slots& view, const uint32_t* w, int64_t n, const std::vector<Column>& cols, bool* hit) {
  LookupRows<16, 2>(view, w, 0, n, cols, hit);
}
int main(int argc, char** argv) {
  int iters = argc > 1 ? atoi(argv[1]) : 20;
  int64_t nb, bs, ns, nw, n, size, cap;
  FILE* f = fopen("meta.txt", "r"); fscanf(f, "%ld %ld %ld %ld %ld %ld %ld", &nb, &bs, &ns, &nw, &n, &size, &cap);
  auto d = Load<uint32_t>("digests.bin"); auto k = Load<uint32_t>("keys.bin"); auto o = Load<uint32_t>("overflow.bin");
  auto words = Load<uint32_t>("batch.bin");
  // the present half twice: 4096 present keys
  std::vector<uint32_t> present(words.begin(), words.begin() + n / 2 * nw);
  present.insert(present.end(), words.begin(), words.begin() + n / 2 * nw);
  std::vector<float> values(ns * 4, 1.0f), out(n * 4), fallback(4, -1.0f);
  std::vector<Column> cols{{reinterpret_cast<const char*>(values.data()), reinterpret_cast<const char*>(fallback.data()), reinterpret_cast<char*>(out.data()), 16, 0}};
  std::unique_ptr<bool[]> hit(new bool[n]);
  Slots view{reinterpret_cast<const uint8_t*>(d.data()), k.data(), o.data(), nb, bs, nw};
  int64_t hits = 0;
  for (int it = 0; it < iters; ++it) { RunFind(view, present.data(), n, cols, hit.get()); for (int64_t i = 0; i < n; ++i) hits += hit[i]; }
  printf("hits %ld\n", hits / iters);
}
