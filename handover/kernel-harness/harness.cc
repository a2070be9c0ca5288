// The lean upsert kernel's body (jaxres_lean_upsert without XLA) over the arrays dump.py wrote, for
// callgrind: see build.sh. Mirrors `Upsert` in storages/lean/kernels.cc; keep the two in step.
#include "storages/lean/kernels.cc"
#include <cstdio>
#include <chrono>
#include <fstream>
#include <iterator>
template <typename T> std::vector<T> Load(const char* f) {
  std::ifstream in(f, std::ios::binary);
  std::vector<char> b((std::istreambuf_iterator<char>(in)), {});
  std::vector<T> v(b.size() / sizeof(T)); std::memcpy(v.data(), b.data(), b.size()); return v;
}
using namespace jaxres; using namespace jaxres::lean;
__attribute__((noinline)) void RunUpsert(Writable& t, const uint32_t* words, int64_t n, int64_t capacity, int64_t size,
    bool* found, int32_t* slot, int32_t* first, bool* admitted) {
  const int64_t W = t.num_words;
  std::vector<uint32_t> hash(n);
  LocateRows<2>(t.View(), words, 0, n, found, slot, hash.data());
  std::unique_ptr<bool[]> is_new(new bool[n]);
  for (int64_t i = 0; i < n; ++i) is_new[i] = !found[i];
  OwnerPerKey(words, n, W, is_new.get(), false, first);
  const int64_t room = std::max<int64_t>(capacity - size, 0);
  std::vector<char> head(n);
  std::vector<int32_t> placed(n, 0);
  int64_t heads = 0;
  for (int64_t i = 0; i < n; ++i) { if (!is_new[i] || first[i] != i) continue; head[i] = ++heads <= room; }
  Place(t, words, hash.data(), n, head, placed.data());
  for (int64_t i = 0; i < n; ++i) { admitted[i] = is_new[i] && head[first[i]]; if (admitted[i]) slot[i] = placed[first[i]]; }
}
int main(int argc, char** argv) {
  int iters = argc > 1 ? atoi(argv[1]) : 20;
  int64_t nb, bs, ns, nw, n, size, cap;
  FILE* f = fopen("meta.txt", "r"); fscanf(f, "%ld %ld %ld %ld %ld %ld %ld", &nb, &bs, &ns, &nw, &n, &size, &cap);
  auto d0 = Load<uint32_t>("digests.bin"); auto k0 = Load<uint32_t>("keys.bin"); auto o0 = Load<uint32_t>("overflow.bin");
  auto words = Load<uint32_t>("batch.bin");
  std::unique_ptr<bool[]> found(new bool[n]), adm(new bool[n]);
  std::vector<int32_t> slot(n), first(n);
  uint64_t check = 0; double best = 1e9;
  for (int it = 0; it < iters; ++it) {
    auto d = d0; auto k = k0; auto o = o0;
    Writable t{reinterpret_cast<uint8_t*>(d.data()), k.data(), o.data(), nb, bs, nw};
    auto s = std::chrono::steady_clock::now();
    RunUpsert(t, words.data(), n, cap, size, found.get(), slot.data(), first.data(), adm.get());
    best = std::min(best, std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - s).count());
    for (int64_t i = 0; i < n; ++i) check = check * 31 + slot[i] + 7 * adm[i] + 3 * found[i];
    for (auto x : d) check = check * 31 + x;
  }
  printf("check %lx best %.1f us\n", (unsigned long)check, best);
}
// The registry the extension module defines (module.cc), which the kernels register into.
std::vector<jaxres::Kernel>& jaxres::Kernels() { static std::vector<jaxres::Kernel> k; return k; }
