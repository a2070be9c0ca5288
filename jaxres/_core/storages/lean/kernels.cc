// CPU kernels of the lean table, registered with XLA's FFI (see
// jaxres/_core/kernels/registration.h):
//
//   jaxres_lean_locate probing.locate          (storages/lean/probing.py)
//   jaxres_lean_lookup LeanTable._lookup_rows  (storages/lean/table.py)
//
// Each computes exactly what its pure-XLA counterpart computes (the XLA code is the reference and
// the GPU/TPU path): the reference reads both buckets' digests at once and settles the rare rows
// (many digest matches, a first bucket with overflow) in a loop; these read one row at a time, the
// candidates of its first bucket, then its second, then the buckets past the first while the last
// one reached has overflow, which is the reference's order. A key is in one slot at most, so both
// find the same slot. The digest lines of a row's two buckets are fetched kAhead rows ahead. The
// rows are split over XLA's intra-op thread pool; every row is computed by exactly one thread from
// inputs no thread writes, so results never depend on scheduling.

#include "kernels.h"

namespace jaxres::lean {
namespace {

// murmur's finalizer of `h ^ seed` (encoding/hashing.py's mix).
inline uint32_t Mix(uint32_t h, uint32_t seed) {
  h ^= seed;
  h ^= h >> 16;
  h *= kHashFinal1;
  h ^= h >> 13;
  h *= kHashFinal2;
  return h ^ (h >> 16);
}

// The slots as the kernels read them (a view of the table's arrays).
struct Slots {
  const uint8_t* digests;  // a digest byte per slot (little-endian: byte k of word j is slot 4 j + k)
  const uint32_t* keys;    // [num_slots, num_words]
  const uint32_t* overflow;  // [num_buckets]
  int64_t num_buckets, bucket_size, num_words;

  // Layout.buckets_of: a key's first and second buckets and its digest (1 to 255).
  void BucketsOf(const uint32_t* w, int64_t* first, int64_t* second, uint32_t* digest) const {
    const uint32_t h = HashWords(w, num_words, kBucketSeed), top = h >> 24;
    const uint32_t nb = static_cast<uint32_t>(num_buckets);
    *first = h % nb;
    *digest = top + (top == 0);
    *second = nb == 1 ? *first : (*first + 1 + Mix(h, kLeanSecondBucketSeed) % (nb - 1)) % nb;
  }

  void Prefetch(int64_t bucket) const {
    const uint8_t* line = digests + bucket * bucket_size;
    for (int64_t at = 0; at < bucket_size; at += 64) __builtin_prefetch(line + at);
  }

  // The first slot of `bucket` whose digest is `digest`, or -1.
  int64_t FirstMatch(int64_t bucket, uint32_t digest) const {
    const uint8_t* line = digests + bucket * bucket_size;
    for (int64_t at = 0; at < bucket_size; ++at) {
      if (line[at] == digest) return bucket * bucket_size + at;
    }
    return -1;
  }

  // The slot of `bucket` that holds key `w` (its digest `digest`), or -1: the slots whose digest
  // matches, in order, their key words compared.
  int64_t Find(int64_t bucket, const uint32_t* w, uint32_t digest) const {
    const int64_t base = bucket * bucket_size;
    const uint8_t* line = digests + base;
    int64_t at = 0;
#if defined(__SSE2__)
    const __m128i d = _mm_set1_epi8(static_cast<char>(digest));
    for (; at + 16 <= bucket_size; at += 16) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(line + at));
      for (uint32_t m = _mm_movemask_epi8(_mm_cmpeq_epi8(bytes, d)); m; m &= m - 1) {
        const int64_t slot = base + at + __builtin_ctz(m);
        if (SameWords(keys + slot * num_words, w, num_words)) return slot;
      }
    }
#endif
    for (; at < bucket_size; ++at) {
      if (line[at] == digest && SameWords(keys + (base + at) * num_words, w, num_words)) return base + at;
    }
    return -1;
  }

  // probing.locate for one key row: true if present, with its slot; for a miss, the first slot of
  // its first bucket. `first`, `second`, `digest`: Layout.buckets_of of the row.
  bool Locate(const uint32_t* w, int64_t first, int64_t second, uint32_t digest, int32_t* out) const {
    int64_t slot = Find(first, w, digest);
    if (slot < 0 && second != first) slot = Find(second, w, digest);
    if (__builtin_expect(slot < 0 && overflow[first] > 0, 0)) {
      // On past the first bucket while the bucket reached has overflow (num_buckets steps at most).
      int64_t at = first;
      for (int64_t steps = 0; slot < 0 && steps < num_buckets; ++steps) {
        at = at + 1 == num_buckets ? 0 : at + 1;
        slot = Find(at, w, digest);
        if (overflow[at] == 0) break;
      }
    }
    *out = static_cast<int32_t>(slot < 0 ? first * bucket_size : slot);
    return slot >= 0;
  }
};

// The buckets of `n` key rows `w`, hashed and their digest lines prefetched kAhead rows before the
// search reads them (in a ring, so the hashing overlaps the memory reads it waits for), then the
// key words of the first digest match of each bucket kLate rows before it.
class BucketsAhead {
 public:
  BucketsAhead(const Slots& t, const uint32_t* w, int64_t n) : t_(t), w_(w), n_(n) {
    for (int64_t k = 0; k < std::min(n, kAhead); ++k) Fetch(k);
  }
  // Row k's buckets and digest; fetches row k + kAhead's.
  void Next(int64_t k, int64_t* first, int64_t* second, uint32_t* digest) {
    if (k + kAhead < n_) Fetch(k + kAhead);
    if (k + kLate < n_) FetchKeys(k + kLate);
    *first = first_[k % kRing];
    *second = second_[k % kRing];
    *digest = digest_[k % kRing];
  }

 private:
  static constexpr int64_t kRing = 2 * kAhead, kLate = kAhead / 2;
  void Fetch(int64_t k) {
    const int64_t r = k % kRing;
    t_.BucketsOf(w_ + k * t_.num_words, &first_[r], &second_[r], &digest_[r]);
    t_.Prefetch(first_[r]);
    t_.Prefetch(second_[r]);
  }
  void FetchKeys(int64_t k) {
    const int64_t r = k % kRing;
    for (int64_t bucket : {first_[r], second_[r]}) {
      const int64_t slot = t_.FirstMatch(bucket, digest_[r]);
      if (slot >= 0) __builtin_prefetch(t_.keys + slot * t_.num_words);
    }
  }
  const Slots& t_;
  const uint32_t* w_;
  int64_t n_, first_[kRing], second_[kRing];
  uint32_t digest_[kRing];
};

Slots View(const ffi::Buffer<ffi::U32>& digests, const ffi::Buffer<ffi::U32>& keys,
           const ffi::Buffer<ffi::U32>& overflow, int64_t bucket_size) {
  return {reinterpret_cast<const uint8_t*>(digests.typed_data()), keys.typed_data(), overflow.typed_data(),
          overflow.dimensions()[0], bucket_size, keys.dimensions()[1]};
}

// ------------------------------------------------------------------ kernels

ffi::Error Locate(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> digests, ffi::Buffer<ffi::U32> keys,
                  ffi::Buffer<ffi::U32> overflow, ffi::Buffer<ffi::U32> words, ffi::ResultBuffer<ffi::PRED> found,
                  ffi::ResultBuffer<ffi::S32> slot, int64_t bucket_size) {
  const Slots t = View(digests, keys, overflow, bucket_size);
  const int64_t W = t.num_words;
  ParallelFor(pool, words.dimensions()[0], kGrain, 1, [&](int64_t begin, int64_t end) {
    const uint32_t* w = words.typed_data() + begin * W;
    BucketsAhead ahead(t, w, end - begin);
    int64_t first, second;
    uint32_t digest;
    for (int64_t k = 0; k < end - begin; ++k) {
      ahead.Next(k, &first, &second, &digest);
      found->typed_data()[begin + k] = t.Locate(w + k * W, first, second, digest, slot->typed_data() + begin + k);
    }
  });
  return ffi::Error::Success();
}

// LeanTable._lookup_rows over rows [begin, end): one pass, where a row's digest lines are fetched
// kAhead rows ahead of its search and its value rows kLag rows ahead of their copy, so both kinds
// of reads overlap. kBytes (4 or 8) > 0: a single column of rows that wide.
template <int64_t kBytes>
void LookupRows(const Slots& t, const uint32_t* w, int64_t begin, int64_t end, const std::vector<Column>& columns,
                bool* hit) {
  constexpr int64_t kLag = 16;
  const int64_t len = end - begin, num_columns = kBytes > 0 ? 1 : columns.size();
  BucketsAhead ahead(t, w + begin * t.num_words, len);
  int32_t slot[kLag];  // the slots (value rows) of the last kLag rows searched
  int64_t first, second;
  uint32_t digest;
  for (int64_t k = 0; k < len + kLag; ++k) {
    if (k >= kLag) {
      const int64_t i = begin + k - kLag;
      for (int64_t c = 0; c < num_columns; ++c) CopyValue<kBytes>(columns[c], i, hit[i], slot[k % kLag]);
    }
    if (k < len) {
      const int64_t i = begin + k;
      ahead.Next(k, &first, &second, &digest);
      hit[i] = t.Locate(w + i * t.num_words, first, second, digest, &slot[k % kLag]);
      for (int64_t c = 0; c < num_columns; ++c) {
        if (kBytes > 0) {  // 4 or 8 bytes: within one cache line
          __builtin_prefetch(columns[c].from + slot[k % kLag] * kBytes);
        } else {
          PrefetchRow(columns[c].from + slot[k % kLag] * columns[c].bytes, columns[c].bytes);
        }
      }
    }
  }
}

// Arguments after `words`: the value leaves [num_slots, ...], then as many default leaves, [n, ...]
// or one row for all; results after `found`: the values [n, ...], each row its slot's value row
// where found, else its default.
ffi::Error Lookup(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> digests, ffi::Buffer<ffi::U32> keys,
                  ffi::Buffer<ffi::U32> overflow, ffi::Buffer<ffi::U32> words, ffi::RemainingArgs leaves,
                  ffi::ResultBuffer<ffi::PRED> found, ffi::RemainingRets outputs, int64_t bucket_size) {
  const int64_t n = words.dimensions()[0];
  std::vector<Column> columns;
  if (!LookupColumns(leaves, outputs, n, columns)) {
    return ffi::Error::InvalidArgument("jaxres_lean_lookup: expected a default leaf per value leaf");
  }
  const int64_t single = columns.size() == 1 ? columns[0].bytes : 0;
  auto rows = single == 4 ? LookupRows<4> : single == 8 ? LookupRows<8> : LookupRows<0>;
  const Slots t = View(digests, keys, overflow, bucket_size);
  ParallelFor(pool, n, kGrain, 1, [&](int64_t begin, int64_t end) {
    rows(t, words.typed_data(), begin, end, columns, found->typed_data());
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxres::lean

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxresLeanLocate, jaxres::lean::Locate,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::PRED>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Attr<int64_t>("bucket_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxresLeanLookup, jaxres::lean::Lookup,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .RemainingArgs()
                                  .Ret<xla::ffi::Buffer<xla::ffi::PRED>>()
                                  .RemainingRets()
                                  .Attr<int64_t>("bucket_size"));

JAXRES_REGISTER_KERNEL("jaxres_lean_locate", JaxresLeanLocate);
JAXRES_REGISTER_KERNEL("jaxres_lean_lookup", JaxresLeanLookup);
