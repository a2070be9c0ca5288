// The CPU kernel of the sorted table, registered with XLA's FFI (see
// jaxres/_core/kernels/registration.h):
//
//   jaxres_search SortedTable._search (storages/sorted/table.py)
//
// It computes exactly what its pure-XLA counterpart computes (the XLA code is
// the reference and the GPU/TPU path), its rows split over XLA's intra-op
// thread pool; every row is computed by exactly one thread from inputs no
// thread writes, so results never depend on scheduling.

#include "kernels.h"

namespace jaxres::sorted {
namespace {

// Lower bounds of `m` keys (`w`, rows of W words) in the sorted rows [base[g], base[g] + len) of
// `keys`, rows at or past `count` reading as larger than any key: branch-free halving whose steps
// depend on `len` only, so the group descends in lockstep and the next row of each is prefetched
// while the others compare. On return base[g] is the lower bound.
template <typename Less>
void LowerBounds(const uint32_t* keys, int64_t W, int64_t len, int64_t m, int64_t* base, const Less& less) {
  for (int64_t left = len; left > 1; left -= left / 2) {
    const int64_t half = left / 2, next_half = (left - half) / 2;
    for (int64_t g = 0; g < m; ++g) {
      base[g] += less(g, base[g] + half) ? half : 0;
      Prefetch(keys + (base[g] + next_half) * W);
    }
  }
  for (int64_t g = 0; g < m; ++g) base[g] += len > 0 && less(g, base[g]) ? 1 : 0;
}

constexpr int64_t kSampleEvery = 64;  // rows per block of the sample a large batch searches first

// The first 64 bits of a key of `num_words` words (one word: shifted up) as one number, which
// orders keys as their words do; the whole key where num_words <= 2.
inline uint64_t Prefix(const uint32_t* w, int64_t num_words) {
  return num_words >= 2 ? (uint64_t{w[0]} << 32) | w[1] : uint64_t{w[0]} << 32;
}

// Whether key a < key b (rows of `num_words` words), branch free.
inline bool Less(const uint32_t* a, const uint32_t* b, int64_t num_words) {
  if (num_words <= 2) return Prefix(a, num_words) < Prefix(b, num_words);
  bool lt = false, eq = true;
  for (int64_t j = 0; j < num_words; ++j) {
    lt |= eq & (a[j] < b[j]);
    eq &= a[j] == b[j];
  }
  return lt;
}

// An index of the sorted sample of a sorted table: the sample's keys, and a directory over the
// bits of their prefixes below those all of them share. Cell c lists the first sample whose
// prefix's cell is c or later, so a key's lower bound in the sample lies between first[c] and
// first[c + 1] for its cell c: a few rows for keys spread evenly, a binary search at worst.
class SampleIndex {
 public:
  SampleIndex(const uint32_t* keys, int64_t count, int64_t num_words) : num_words_(num_words) {
    const int64_t blocks = (count + kSampleEvery - 1) / kSampleEvery;
    sample_.resize(blocks * num_words);
    for (int64_t j = 0; j < blocks; ++j) {
      std::memcpy(&sample_[j * num_words], keys + j * kSampleEvery * num_words, num_words * sizeof(uint32_t));
    }
    low_ = Prefix(&sample_[0], num_words);
    high_ = Prefix(&sample_[(blocks - 1) * num_words], num_words);
    shared_ = low_ == high_ ? 64 : __builtin_clzll(low_ ^ high_);
    bits_ = shared_ == 64 ? 0 : std::min<int>({BitLength(blocks), 20, 64 - shared_});
    first_.assign((int64_t{1} << bits_) + 1, 0);
    for (int64_t j = 0; j < blocks; ++j) ++first_[Cell(Prefix(&sample_[j * num_words], num_words)) + 1];
    for (size_t c = 1; c < first_.size(); ++c) first_[c] += first_[c - 1];
  }

  // The number of sample rows below `key`.
  int64_t LowerBound(const uint32_t* key) const {
    const uint64_t prefix = Prefix(key, num_words_);
    if (prefix < low_) return 0;
    if (prefix > high_) return first_.back();
    const int64_t c = Cell(prefix);
    int64_t low = first_[c], len = first_[c + 1] - low;
    while (len > 0) {
      const int64_t half = len / 2;
      const bool below = Less(&sample_[(low + half) * num_words_], key, num_words_);
      low = below ? low + half + 1 : low;
      len = below ? len - half - 1 : half;
    }
    return low;
  }

 private:
  // The directory cell of a prefix in [low_, high_]: its bits after the shared ones.
  int64_t Cell(uint64_t prefix) const {
    return bits_ == 0 ? 0 : static_cast<int64_t>((prefix << shared_) >> (64 - bits_));
  }

  int64_t num_words_;
  std::vector<uint32_t> sample_;
  uint64_t low_, high_;
  int shared_, bits_;
  std::vector<int32_t> first_;
};

// SortedTable._search: each key's lower bound in the sorted rows [0, count), and whether the
// key is there. A batch large enough to pay for it first indexes a sample (every 64th row:
// small enough to stay in cache, see SampleIndex) to find each key's block, then searches that
// block of 64 rows: a few cache misses per key instead of one per level of the whole array.
ffi::Error Search(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> sorted, ffi::Buffer<ffi::S32> count_in,
                  ffi::Buffer<ffi::U32> words, ffi::ResultBuffer<ffi::PRED> present, ffi::ResultBuffer<ffi::S32> position) {
  constexpr int64_t kGroup = 64;
  const int64_t n = words.dimensions()[0];
  const int64_t count = std::clamp<int64_t>(count_in.typed_data()[0], 0, sorted.dimensions()[0]);
  const bool sampled = count >= 64 * kSampleEvery && n * 8 * kSampleEvery >= count;
  auto search = [&](auto num_words) {
    constexpr int64_t kWords = decltype(num_words)::value;
    const int64_t W = kWords > 0 ? kWords : sorted.dimensions()[1];
    const uint32_t* keys = sorted.typed_data();
    const uint32_t* w = words.typed_data();
    std::optional<SampleIndex> index;
    if (sampled) index.emplace(keys, count, W);
    ParallelFor(pool, n, kGrain, kGroup, [&](int64_t begin, int64_t end) {
      for (int64_t start = begin; start < end; start += kGroup) {
        const int64_t m = std::min(kGroup, end - start), len = sampled ? kSampleEvery : count;
        const uint32_t* group = w + start * W;
        int64_t base[kGroup] = {};
        // Block j-1 of the sample holds the last row below the key: its lower bound is in the
        // 64 rows after that block's first.
        for (int64_t g = 0; sampled && g < m; ++g) {
          const int64_t j = index->LowerBound(group + g * W);
          base[g] = j == 0 ? 0 : (j - 1) * kSampleEvery + 1;
        }
        LowerBounds(keys, W, len, m, base, [&](int64_t g, int64_t row) {
          return row < count && Less(keys + row * W, group + g * W, W);
        });
        for (int64_t g = 0; g < m; ++g) {
          const int64_t i = start + g, low = std::min(base[g], count);
          position->typed_data()[i] = static_cast<int32_t>(low);
          present->typed_data()[i] = low < count && SameWords(keys + low * W, w + i * W, W);
        }
      }
    });
    return ffi::Error::Success();
  };
  switch (sorted.dimensions()[1]) {
    case 1:
      return search(std::integral_constant<int64_t, 1>());
    case 2:
      return search(std::integral_constant<int64_t, 2>());
    default:
      return search(std::integral_constant<int64_t, 0>());
  }
}

}  // namespace
}  // namespace jaxres::sorted

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxresSearch, jaxres::sorted::Search,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::PRED>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>());

JAXRES_REGISTER_KERNEL("jaxres_search", JaxresSearch);
