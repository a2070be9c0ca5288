// What dump.py wrote, as the harnesses read it, and the lean kernels they call (see build.sh).
#include "storages/lean/kernels.cc"

#include <cstdio>
#include <fstream>
#include <iterator>

// The registry the extension module defines (module.cc), which the kernels register into.
std::vector<jaxres::Kernel>& jaxres::Kernels() {
  static std::vector<jaxres::Kernel> kernels;
  return kernels;
}

// The table's arrays and the batch of key rows.
struct Dumped {
  int64_t num_buckets, bucket_size, num_slots, num_words, n, size, capacity;
  std::vector<uint32_t> digests, keys, overflow, words;

  static std::vector<uint32_t> Load(const char* path) {
    std::ifstream in(path, std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(in)), {});
    std::vector<uint32_t> v(bytes.size() / sizeof(uint32_t));
    std::memcpy(v.data(), bytes.data(), bytes.size());
    return v;
  }
  Dumped() : digests(Load("digests.bin")), keys(Load("keys.bin")), overflow(Load("overflow.bin")), words(Load("batch.bin")) {
    FILE* meta = fopen("meta.txt", "r");
    if (!meta || fscanf(meta, "%ld %ld %ld %ld %ld %ld %ld", &num_buckets, &bucket_size, &num_slots, &num_words, &n,
                        &size, &capacity) != 7) {
      fprintf(stderr, "meta.txt: run dump.py here first\n");
      exit(1);
    }
    fclose(meta);
  }
};
