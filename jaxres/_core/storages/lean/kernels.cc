// CPU kernels of the lean table, registered with XLA's FFI (see
// jaxres/_core/kernels/registration.h):
//
//   jaxres_lean_locate probing.locate          (storages/lean/probing.py)
//   jaxres_lean_lookup LeanTable._lookup_rows  (storages/lean/table.py)
//   jaxres_lean_upsert placing.upsert_slots    (storages/lean/placing.py)
//   jaxres_lean_evict  eviction.evict          (storages/lean/eviction.py)
//
// Each computes exactly what its pure-XLA counterpart computes (the XLA code is the reference and
// the GPU/TPU path): the reference reads both buckets' digests at once and settles the rare rows
// (many digest matches, a first bucket with overflow) in a loop; these read one row at a time: the
// first digest match of each of its two buckets compared at once (where most keys are), then the
// other matches of its first bucket, of its second, then the buckets past the first while the last
// one reached has overflow, which is the reference's order. A key is in one slot at most, so both
// find the same slot. The digest lines of a row's two buckets are fetched kAhead rows ahead. The
// rows are split over XLA's intra-op thread pool; every row is computed by exactly one thread from
// inputs no thread writes, so results never depend on scheduling.
//
// The writes (upsert, evict) replay their reference's rounds one after the other on one thread:
// each round takes the same lowest pending rows, chooses from the slots as the round began, and
// settles its claims by the same hashed cells (claims.cell_of: rows that meet in a cell lose to the
// lowest of them even where their slots differ), so every round ends as the reference's does. The
// table's arrays are updated in place (aliased).

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

// x % d for any 32-bit x and a divisor d > 0 fixed ahead, by two multiplications in place of a
// division (Lemire, Kaser and Kurz, "Faster remainder by direct computation", 2019): exact.
class Modulus {
 public:
  explicit Modulus(uint32_t d) : m_(~uint64_t{0} / d + 1), d_(d) {}
  uint32_t Of(uint32_t x) const {
#if defined(__SIZEOF_INT128__)
    return static_cast<uint32_t>((static_cast<unsigned __int128>(m_ * x) * d_) >> 64);
#else
    return x % d_;
#endif
  }

 private:
  uint64_t m_;
  uint32_t d_;
};

// The slots of one bucket whose digest is a given one, as a set of offsets (bit j % 64 of word j / 64:
// offset j; buckets hold at most 128 slots).
struct Matches {
  uint64_t bits[2];

  bool Any() const { return (bits[0] | bits[1]) != 0; }
  // Whether the set holds more than one offset.
  bool Several() const {
    return ((bits[0] & (bits[0] - 1)) | (bits[1] & (bits[1] - 1))) != 0 || (bits[0] && bits[1]);
  }
  // The lowest offset in the set (0 where it is empty), without a branch on the data.
  int64_t First() const {
    const int64_t low = __builtin_ctzll(bits[0] | uint64_t{1} << 63);
    const int64_t high = 64 + __builtin_ctzll(bits[1] | uint64_t{1} << 63);
    const int64_t first = bits[0] ? low : high;
    return Any() ? first : 0;
  }
  void DropFirst() {
    if (bits[0]) {
      bits[0] &= bits[0] - 1;
    } else {
      bits[1] &= bits[1] - 1;
    }
  }
};

// A key row's hash (encoding.hash_words), two buckets and digest (Layout.buckets_of), and the slots of
// each bucket whose digest matches.
struct Probe {
  int64_t first, second;
  uint32_t hash, digest;
  Matches in_first, in_second;
};

// Whether key words `a` and `b` agree: every word compared, no early exit (a branch taken at random).
inline bool SameKey(const uint32_t* a, const uint32_t* b, int64_t num_words) {
  uint32_t differ = 0;
  for (int64_t j = 0; j < num_words; ++j) differ |= a[j] ^ b[j];
  return differ == 0;
}

#if defined(__SSE2__)
// Bit j set where byte j of the 16 at `line` is the byte of `d` (16 copies).
__attribute__((always_inline)) inline uint64_t BlockBits(const uint8_t* line, __m128i d) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(line));
  return static_cast<uint32_t>(_mm_movemask_epi8(_mm_cmpeq_epi8(bytes, d)));
}


// The matches among the 64 bytes at `line`.
__attribute__((always_inline)) inline uint64_t Blocks4(const uint8_t* line, __m128i d) {
  return BlockBits(line, d) | BlockBits(line + 16, d) << 16 | BlockBits(line + 32, d) << 32 |
         BlockBits(line + 48, d) << 48;
}
#endif

// The slots as the kernels read them (a view of the table's arrays), for keys of kWords words (0:
// any number, `num_words`): the read kernels are compiled for one and two words (int32 and int64
// keys), where the hash and the key compares unroll.
template <int64_t kWords = 0>
struct SlotsOf {
  SlotsOf(const uint8_t* digests, const uint32_t* keys, const uint32_t* overflow, int64_t num_buckets,
        int64_t bucket_size, int64_t num_words)
      : digests(digests), keys(keys), overflow(overflow), num_buckets(num_buckets), bucket_size(bucket_size),
        num_words(num_words), buckets_(static_cast<uint32_t>(num_buckets)),
        others_(static_cast<uint32_t>(std::max<int64_t>(num_buckets - 1, 1))) {}

  const uint8_t* digests;  // a digest byte per slot (little-endian: byte k of word j is slot 4 j + k)
  const uint32_t* keys;    // [num_slots, num_words]
  const uint32_t* overflow;  // [num_buckets]
  int64_t num_buckets, bucket_size, num_words;

  int64_t words() const { return kWords > 0 ? kWords : num_words; }
  // This view for keys of K words.
  template <int64_t K>
  SlotsOf<K> As() const {
    return {digests, keys, overflow, num_buckets, bucket_size, num_words};
  }

  // The hash of key row `w` (encoding.hash_words), from which its buckets, digest and lane follow.
  uint32_t Hash(const uint32_t* w) const { return HashWords(w, words(), kBucketSeed); }

  // Layout.buckets_of: a key's first and second buckets and its digest (1 to 255).
  void BucketsOf(const uint32_t* w, int64_t* first, int64_t* second, uint32_t* digest) const {
    BucketsOfHash(Hash(w), first, second, digest);
  }
  // Layout.buckets_of from the key's hash `h`.
  void BucketsOfHash(uint32_t h, int64_t* first, int64_t* second, uint32_t* digest) const {
    const uint32_t top = h >> 24;
    *first = buckets_.Of(h);
    *digest = top + (top == 0);
    if (num_buckets == 1) {
      *second = *first;
    } else {  // first + 1 + other < 2 num_buckets: one subtraction is the last `% num_buckets`
      const int64_t at = *first + 1 + others_.Of(Mix(h, kLeanSecondBucketSeed));
      *second = at >= num_buckets ? at - num_buckets : at;
    }
  }

  void FetchBucket(int64_t bucket) const {
    const uint8_t* line = digests + bucket * bucket_size;
    for (int64_t at = 0; at < bucket_size; at += 64) Prefetch(line + at);
  }

  // The slots of `bucket` whose digest is `digest`: 16 digests compared at a time, a bucket whose
  // size is not a multiple of 16 read to its end by a last load that overlaps the one before.
  __attribute__((always_inline)) Matches MatchesIn(int64_t bucket, uint32_t digest) const {
    const uint8_t* line = digests + bucket * bucket_size;
#if defined(__SSE2__)
    if (bucket_size >= 16) {
      const __m128i d = _mm_set1_epi8(static_cast<char>(digest));
      // The largest buckets (64 slots, 128 where the table evicts) unrolled: every bucket of a table
      // has the same size, so the branch is always taken the same way.
      if (bucket_size == 64) return {{Blocks4(line, d), 0}};
      if (bucket_size == 128) return {{Blocks4(line, d), Blocks4(line + 64, d)}};
      const int64_t blocks = bucket_size >> 4;
      uint64_t low = 0, high = 0;  // offsets 0-63, 64-127
      for (int64_t b = 0; b < std::min<int64_t>(blocks, 4); ++b) low |= BlockBits(line + 16 * b, d) << (16 * b);
      for (int64_t b = 4; b < blocks; ++b) high |= BlockBits(line + 16 * b, d) << (16 * (b - 4));
      Matches m{{low, high}};
      const int64_t tail = bucket_size & 15, at = bucket_size - tail;
      if (tail) m.bits[at >> 6] |= BlockBits(line + bucket_size - 16, d) >> (16 - tail) << (at & 63);
      return m;
    }
#endif
    Matches m{{0, 0}};
    for (int64_t at = 0; at < bucket_size; ++at) m.bits[at >> 6] |= uint64_t{line[at] == digest} << (at & 63);
    return m;
  }

  // The slot of `bucket` among `matches` that holds key `w`, or -1.
  int64_t Find(int64_t bucket, const uint32_t* w, Matches matches) const {
    for (; matches.Any(); matches.DropFirst()) {
      const int64_t slot = bucket * bucket_size + matches.First();
      if (SameKey(keys + slot * words(), w, words())) return slot;
    }
    return -1;
  }

  // The slot a lookup of `probe` reads first in each bucket: its first digest match (the bucket's
  // first slot where none).
  void FirstCandidates(const Probe& probe, int64_t* a, int64_t* b) const {
    *a = probe.first * bucket_size + probe.in_first.First();
    *b = probe.second * bucket_size + probe.in_second.First();
  }

  // probing.locate for one key row: true if present, with its slot; for a miss, the first slot of
  // its first bucket. `probe`: the row's buckets, digest and digest matches. Most keys sit at the
  // first digest match of one of their buckets: both are compared at once and one is selected
  // without a branch on which (a branch there is taken at random); the rest go to `Search`.
  bool Locate(const uint32_t* w, const Probe& probe, int32_t* out) const {
    int64_t a, b;
    FirstCandidates(probe, &a, &b);
    const bool at_a = probe.in_first.Any() & SameKey(keys + a * words(), w, words());
    const bool at_b = probe.in_second.Any() & SameKey(keys + b * words(), w, words());
    if (__builtin_expect(at_a | at_b, 1)) {
      *out = static_cast<int32_t>(at_a ? a : b);
      return true;
    }
    // Most misses end here: no other digest match in either bucket, no key past the first bucket.
    if (!probe.in_first.Several() && !probe.in_second.Several() && overflow[probe.first] == 0) {
      *out = static_cast<int32_t>(probe.first * bucket_size);
      return false;
    }
    return Search(w, probe, out);
  }

 private:
  // Locate past both first candidates: the other digest matches of the first bucket, then of the
  // second, then the buckets past the first while the last one reached has overflow (num_buckets
  // steps at most).
  __attribute__((noinline)) bool Search(const uint32_t* w, Probe probe, int32_t* out) const {
    const int64_t first = probe.first, second = probe.second;
    probe.in_first.DropFirst();
    probe.in_second.DropFirst();
    int64_t slot = Find(first, w, probe.in_first);
    if (slot < 0 && second != first) slot = Find(second, w, probe.in_second);
    if (slot < 0 && overflow[first] > 0) {
      int64_t at = first;
      for (int64_t steps = 0; slot < 0 && steps < num_buckets; ++steps) {
        at = at + 1 == num_buckets ? 0 : at + 1;
        slot = Find(at, w, MatchesIn(at, probe.digest));
        if (overflow[at] == 0) break;
      }
    }
    *out = static_cast<int32_t>(slot < 0 ? first * bucket_size : slot);
    return slot >= 0;
  }

  Modulus buckets_, others_;  // num_buckets, and num_buckets - 1 (the second bucket's offset)
};

using Slots = SlotsOf<>;

// The probes of `n` key rows `w`, in a ring: each row hashed and its buckets' digest lines
// prefetched kAhead rows before its search (so the hashing overlaps the memory reads it waits for),
// then kLate rows before it the digest matches of each bucket found and the key words of each
// bucket's first match prefetched.
template <typename S>
class BucketsAhead {
 public:
  BucketsAhead(const S& t, const uint32_t* w, int64_t n) : t_(t), w_(w), n_(n) {
    for (int64_t k = 0; k < std::min(n, kAhead); ++k) Fetch(k);
    for (int64_t k = 0; k < std::min(n, kLate); ++k) FetchKeys(k);
  }
  // Row k's probe; fetches the digest lines of row k + kAhead and the keys of row k + kLate.
  const Probe& Next(int64_t k) {
    if (k + kAhead < n_) Fetch(k + kAhead);
    if (k + kLate < n_) FetchKeys(k + kLate);
    return ring_[k % kRing];
  }

 private:
  static constexpr int64_t kRing = 2 * kAhead, kLate = kAhead / 2;
  void Fetch(int64_t k) {
    Probe& p = ring_[k % kRing];
    p.hash = t_.Hash(w_ + k * t_.words());
    t_.BucketsOfHash(p.hash, &p.first, &p.second, &p.digest);
    t_.FetchBucket(p.first);
    t_.FetchBucket(p.second);
  }
  void FetchKeys(int64_t k) {
    Probe& p = ring_[k % kRing];
    p.in_first = t_.MatchesIn(p.first, p.digest);
    p.in_second = p.second == p.first ? p.in_first : t_.MatchesIn(p.second, p.digest);
    int64_t a, b;
    t_.FirstCandidates(p, &a, &b);
    Prefetch(t_.keys + a * t_.words());
    Prefetch(t_.keys + b * t_.words());
  }
  const S& t_;
  const uint32_t* w_;
  int64_t n_;
  Probe ring_[kRing];
};

Slots View(const ffi::Buffer<ffi::U32>& digests, const ffi::Buffer<ffi::U32>& keys,
           const ffi::Buffer<ffi::U32>& overflow, int64_t bucket_size) {
  return {reinterpret_cast<const uint8_t*>(digests.typed_data()), keys.typed_data(), overflow.typed_data(),
          overflow.dimensions()[0], bucket_size, keys.dimensions()[1]};
}

// probing.locate for key rows [begin, end) of `w`, keys of kWords words; each row's hash in `hash`
// where it is not null (the writes place new keys from it).
template <int64_t kWords>
void LocateRows(const Slots& view, const uint32_t* w, int64_t begin, int64_t end, bool* found, int32_t* slot,
                uint32_t* hash) {
  const SlotsOf<kWords> t = view.As<kWords>();
  BucketsAhead ahead(t, w + begin * t.words(), end - begin);
  for (int64_t i = begin; i < end; ++i) {
    const Probe& probe = ahead.Next(i - begin);
    found[i] = t.Locate(w + i * t.words(), probe, slot + i);
    if (hash != nullptr) hash[i] = probe.hash;
  }
}

// body(K) for K the key width of `num_words` as the reads are compiled: 1 or 2 words (int32 and int64
// keys), else 0 (any width, read at run time). K is a std::integral_constant, usable as a template
// argument.
template <typename Body>
void WithWords(int64_t num_words, const Body& body) {
  if (num_words == 2) {
    body(std::integral_constant<int64_t, 2>{});
  } else if (num_words == 1) {
    body(std::integral_constant<int64_t, 1>{});
  } else {
    body(std::integral_constant<int64_t, 0>{});
  }
}

// probing.locate for the `n` key rows `w`, split over the thread pool (`hash`: as LocateRows).
void LocateAll(ffi::ThreadPool& pool, const Slots& view, const uint32_t* w, int64_t n, bool* found, int32_t* slot,
               uint32_t* hash = nullptr) {
  WithWords(view.num_words, [&](auto words) {
    ParallelFor(pool, n, kGrain, 1, [&](int64_t begin, int64_t end) {
      LocateRows<words>(view, w, begin, end, found, slot, hash);
    });
  });
}

// ------------------------------------------------------------------ kernels

ffi::Error Locate(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> digests, ffi::Buffer<ffi::U32> keys,
                  ffi::Buffer<ffi::U32> overflow, ffi::Buffer<ffi::U32> words, ffi::ResultBuffer<ffi::PRED> found,
                  ffi::ResultBuffer<ffi::S32> slot, int64_t bucket_size) {
  LocateAll(pool, View(digests, keys, overflow, bucket_size), words.typed_data(), words.dimensions()[0],
            found->typed_data(), slot->typed_data());
  return ffi::Error::Success();
}

// LeanTable._lookup_rows over rows [begin, end): one pass, where a row's digest lines are fetched
// kAhead rows ahead of its search and its value rows kLag rows ahead of their copy, so both kinds
// of reads overlap. kBytes (4, 8 or 16) > 0: a single column of rows that wide; keys of kWords words.
template <int64_t kBytes, int64_t kWords>
void LookupRows(const Slots& view, const uint32_t* w, int64_t begin, int64_t end, const std::vector<Column>& columns,
                bool* hit) {
  constexpr int64_t kLag = 16;
  const SlotsOf<kWords> t = view.As<kWords>();
  const int64_t len = end - begin, num_columns = kBytes > 0 ? 1 : columns.size();
  BucketsAhead ahead(t, w + begin * t.words(), len);
  int32_t slot[kLag];  // the slots (value rows) of the last kLag rows searched
  for (int64_t k = 0; k < len + kLag; ++k) {
    if (k >= kLag) {
      const int64_t i = begin + k - kLag;
      for (int64_t c = 0; c < num_columns; ++c) CopyValue<kBytes>(columns[c], i, hit[i], slot[k % kLag]);
    }
    if (k < len) {
      const int64_t i = begin + k;
      hit[i] = t.Locate(w + i * t.words(), ahead.Next(k), &slot[k % kLag]);
      for (int64_t c = 0; c < num_columns; ++c) {
        if (kBytes > 0) {  // 4, 8 or 16 bytes: within one cache line
          Prefetch(columns[c].from + slot[k % kLag] * kBytes);
        } else {
          PrefetchRow(columns[c].from + slot[k % kLag] * columns[c].bytes, columns[c].bytes);
        }
      }
    }
  }
}

// LookupRows for keys of kWords words and a single column of rows `single` bytes wide (0: other).
template <int64_t kWords>
auto RowsFor(int64_t single) {
  switch (single) {
    case 4:
      return LookupRows<4, kWords>;
    case 8:
      return LookupRows<8, kWords>;
    case 16:
      return LookupRows<16, kWords>;
    default:
      return LookupRows<0, kWords>;
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
  const Slots t = View(digests, keys, overflow, bucket_size);
  WithWords(t.num_words, [&](auto key_words) {
    auto rows = RowsFor<key_words>(single);
    ParallelFor(pool, n, kGrain, 1, [&](int64_t begin, int64_t end) {
      rows(t, words.typed_data(), begin, end, columns, found->typed_data());
    });
  });
  return ffi::Error::Success();
}


// ------------------------------------------------------------------ writes

// A slot bitmask of one bucket (up to 128 slots): bit j of word j / 64 is slot j; `count` bits set.
struct Bits {
  uint64_t word[2] = {0, 0};
  int count = 0;
  // The position of the k-th set bit (from 0), k below count (layout.nth_bit).
  int Nth(int k) const {
    if (word[1] == 0) return Select64(word[0], k);
    const int low = BitCount64(word[0]);
    return k < low ? Select64(word[0], k) : 64 + Select64(word[1], k - low);
  }
};

#if defined(__SSE2__)
// The free slots (digest 0) among the 16 x kBlocks digests at `line` into `bits`, from slot `at`;
// their count added to bits->count.
template <int kBlocks>
__attribute__((always_inline)) inline void FreeBlocks(const uint8_t* line, int64_t at, Bits* bits) {
  const __m128i zero = _mm_setzero_si128();
  __m128i counts = zero;  // free slots seen, per byte of the 16 (at most 8 each: 128 slots)
  for (int b = 0; b < kBlocks; ++b, at += 16) {
    const __m128i free = _mm_cmpeq_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(line + at)), zero);
    counts = _mm_sub_epi8(counts, free);  // a free byte compares to -1
    bits->word[at >> 6] |= static_cast<uint64_t>(static_cast<uint32_t>(_mm_movemask_epi8(free))) << (at & 63);
  }
  const __m128i sums = _mm_sad_epu8(counts, zero);  // the two halves' totals
  bits->count += _mm_cvtsi128_si32(sums) + _mm_extract_epi16(sums, 4);
}
#endif

// The free slots (digest 0) of `bucket`, as layout.free, and their count.
inline Bits FreeSlots(const uint8_t* digests, int64_t bucket, int64_t bucket_size) {
  const uint8_t* line = digests + bucket * bucket_size;
  Bits bits;
  int64_t at = 0;
#if defined(__SSE2__)
  // The largest buckets (64 slots, 128 where the table evicts) unrolled, as in MatchesIn.
  if (bucket_size == 64) {
    FreeBlocks<4>(line, 0, &bits);
    return bits;
  }
  if (bucket_size == 128) {
    FreeBlocks<8>(line, 0, &bits);
    return bits;
  }
  for (; at + 16 <= bucket_size; at += 16) FreeBlocks<1>(line, at, &bits);
#endif
  for (; at < bucket_size; ++at) {
    if (line[at] == 0) {
      bits.word[at >> 6] |= uint64_t{1} << (at & 63);
      ++bits.count;
    }
  }
  return bits;
}

// Layout.second_choice: whether a new key takes its second bucket, given both buckets' free slots.
inline bool SecondChoice(int free_first, int free_second) {
  return free_second > free_first + kLeanFirstBucketBias || (free_first == 0 && free_second > 0);
}

// Layout.lane: which free slot a new key tries first, in [0, 2^16), from its hash.
inline uint32_t Lane(uint32_t hash) { return Mix(hash, kLaneSeed) >> 16; }

// The table's arrays as the write kernels update them (the results, aliased to the arguments).
struct Writable {
  uint8_t* digests;
  uint32_t* keys;
  uint32_t* overflow;
  int64_t num_buckets, bucket_size, num_words;

  Slots View() const { return {digests, keys, overflow, num_buckets, bucket_size, num_words}; }

  // The entry of key `w` (digest `digest`) into free or evicted `slot`.
  void Store(int64_t slot, const uint32_t* w, uint32_t digest) {
    digests[slot] = static_cast<uint8_t>(digest);
    std::memcpy(keys + slot * num_words, w, num_words * sizeof(uint32_t));
  }

  // Layout.shift_overflow for one key: `delta` in every bucket from `first` up to (not including)
  // the bucket of `slot`.
  void ShiftOverflow(int64_t first, int64_t slot, uint32_t delta) {
    const int64_t distance = ((slot / bucket_size - first) % num_buckets + num_buckets) % num_buckets;
    for (int64_t r = 0, at = first; r < distance; ++r, at = at + 1 == num_buckets ? 0 : at + 1) {
      overflow[at] += delta;
    }
  }
};

// A result that updates an argument: the argument's data, copied where XLA did not alias the two.
template <ffi::DataType T>
auto* InPlace(const ffi::Buffer<T>& in, ffi::ResultBuffer<T>& out) {
  auto* data = out->typed_data();
  if (data != in.typed_data()) std::memcpy(data, in.typed_data(), in.size_bytes());
  return data;
}

// One round of claims (claims.lowest_writer over claims.cell_of): which of a round's positions win
// their candidate slot. `candidate[p] < 0`: position p does not try. `scratch_size`: the reference's
// scratch for rounds of its width (not the number of rows this round holds).
class Claims {
 public:
  void Settle(const std::vector<int64_t>& candidate, int32_t rounds, int64_t scratch_size, std::vector<char>& won) {
    const int64_t r = candidate.size();
    cells_.resize(r);
    trying_.resize(r);
    for (int64_t p = 0; p < r; ++p) {
      trying_[p] = candidate[p] >= 0;
      cells_[p] = trying_[p] ? CellOf(static_cast<int32_t>(candidate[p]), rounds, scratch_size) : 0;
    }
    LowestWriter(cells_, trying_, scratch_size, scratch_, writer_);
    won.resize(r);
    for (int64_t p = 0; p < r; ++p) won[p] = trying_[p] && writer_[p] == p;
  }

 private:
  std::vector<int64_t> cells_;
  std::vector<char> trying_;
  std::vector<int32_t> scratch_, writer_;
};

// placing.place: the `pending` rows (distinct new keys, as many as there are free slots) placed, in
// pair rounds of the lowest `m` pending rows, then the rows whose two buckets were full probing on,
// `chunk` rows a round. `hash`: each row's (SlotsOf::Hash). Sets `slot` of each placed row.
void Place(Writable& t, const uint32_t* words, const uint32_t* hash, int64_t n, const std::vector<char>& pending,
           int32_t* slot) {
  const int64_t W = t.num_words, size = t.bucket_size, nb = t.num_buckets;
  const int64_t m = std::min(n, std::max<int64_t>(kChunkMinRows, kLeanRowsPerBucket * nb));
  const int64_t chunk = ChunkSize(n);
  std::vector<int64_t> queue, rest, candidate;
  std::vector<int64_t> first(n), second(n);
  std::vector<uint32_t> digest(n), lane(n);
  std::vector<char> won;
  const Slots view = t.View();
  for (int64_t i = 0; i < n; ++i) {
    if (!pending[i]) continue;
    view.BucketsOfHash(hash[i], &first[i], &second[i], &digest[i]);
    lane[i] = Lane(hash[i]);
    queue.push_back(i);
  }
  Claims claims;
  int32_t rounds = 0;
  // A round: `choose(i)` is row i's candidate slot (-1: none this round); `keep(i)` whether a row
  // that did not win stays pending. The winners store their keys after every row has chosen.
  auto round = [&](int64_t width, auto choose, auto keep) {
    const int64_t r = std::min<int64_t>(width, queue.size());
    candidate.resize(r);
    for (int64_t p = 0; p < r; ++p) candidate[p] = choose(queue[p]);
    claims.Settle(candidate, rounds, ScratchSize(width), won);
    rest.clear();
    for (int64_t p = 0; p < r; ++p) {
      const int64_t i = queue[p];
      if (won[p]) {
        t.Store(candidate[p], words + i * W, digest[i]);
        slot[i] = static_cast<int32_t>(candidate[p]);
      } else if (keep(i)) {
        rest.push_back(i);
      }
    }
    rest.insert(rest.end(), queue.begin() + r, queue.end());
    queue.swap(rest);
    ++rounds;
  };
  auto take = [&](int64_t bucket, const Bits& free, uint32_t key_lane) {
    return bucket * size + free.Nth(static_cast<int>((key_lane * static_cast<uint32_t>(free.count)) >> 16));
  };
  std::vector<char> spilled(n);
  while (!queue.empty()) {  // pairs
    round(
        m,
        [&](int64_t i) -> int64_t {
          const Bits a = FreeSlots(t.digests, first[i], size), b = FreeSlots(t.digests, second[i], size);
          const int ca = a.count, cb = b.count;
          if (ca == 0 && cb == 0) {
            spilled[i] = 1;
            return -1;
          }
          return SecondChoice(ca, cb) ? take(second[i], b, lane[i]) : take(first[i], a, lane[i]);
        },
        [&](int64_t i) { return !spilled[i]; });
  }
  for (int64_t i = 0; i < n; ++i) {
    if (spilled[i]) queue.push_back(i);
  }
  std::vector<int64_t> cursor = first;
  while (!queue.empty()) {  // probing on
    round(
        chunk,
        [&](int64_t i) -> int64_t {
          const int64_t bucket = (cursor[i] + 1) % nb;
          const Bits free = FreeSlots(t.digests, bucket, size);
          if (free.count == 0) {
            cursor[i] = bucket;
            return -1;
          }
          return take(bucket, free, lane[i]);
        },
        [](int64_t) { return true; });
  }
  for (int64_t i = 0; i < n; ++i) {
    if (spilled[i]) t.ShiftOverflow(first[i], slot[i], 1);
  }
}

// placing.upsert_slots: the keys of the active rows located, the new ones that fit admitted (the
// first `capacity - size` distinct ones) and placed.
ffi::Error Upsert(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> digests_in, ffi::Buffer<ffi::U32> keys_in,
                  ffi::Buffer<ffi::U32> overflow_in, ffi::Buffer<ffi::U32> words_in, ffi::Buffer<ffi::PRED> active_in,
                  ffi::Buffer<ffi::S32> size_in, ffi::ResultBuffer<ffi::U32> digests_out,
                  ffi::ResultBuffer<ffi::U32> keys_out, ffi::ResultBuffer<ffi::U32> overflow_out,
                  ffi::ResultBuffer<ffi::PRED> found_out, ffi::ResultBuffer<ffi::S32> slot_out,
                  ffi::ResultBuffer<ffi::PRED> admitted_out, ffi::ResultBuffer<ffi::S32> dropped_out,
                  ffi::ResultBuffer<ffi::S32> first_out, int64_t bucket_size, int64_t capacity) {
  Writable t{reinterpret_cast<uint8_t*>(InPlace(digests_in, digests_out)), InPlace(keys_in, keys_out),
             InPlace(overflow_in, overflow_out), overflow_in.dimensions()[0], bucket_size, keys_in.dimensions()[1]};
  if (words_in.dimensions().size() != 2 || words_in.dimensions()[1] != t.num_words) {
    return ffi::Error::InvalidArgument("jaxres_lean_upsert: expected key rows as wide as the table's keys");
  }
  const int64_t n = words_in.dimensions()[0], W = t.num_words;
  const uint32_t* words = words_in.typed_data();
  const bool* active = active_in.typed_data();
  bool* found = found_out->typed_data();
  bool* admitted = admitted_out->typed_data();
  int32_t* slot = slot_out->typed_data();
  int32_t* first = first_out->typed_data();
  dropped_out->typed_data()[0] = 0;
  if (n == 0) return ffi::Error::Success();
  std::vector<uint32_t> hash(n);
  LocateAll(pool, t.View(), words, n, found, slot, hash.data());  // reads alone
  std::unique_ptr<bool[]> is_new(new bool[n]);
  for (int64_t i = 0; i < n; ++i) is_new[i] = active[i] && !found[i];
  OwnerPerKey(words, n, W, is_new.get(), false, first);
  const int64_t room = std::max<int64_t>(capacity - size_in.typed_data()[0], 0);
  std::vector<char> head(n);  // the first row of each new key that fits
  std::vector<int32_t> placed(n, 0);
  int64_t heads = 0, taken = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!is_new[i] || first[i] != i) continue;
    head[i] = ++heads <= room;
    taken += head[i];
  }
  dropped_out->typed_data()[0] = static_cast<int32_t>(heads - taken);
  Place(t, words, hash.data(), n, head, placed.data());
  for (int64_t i = 0; i < n; ++i) {
    admitted[i] = is_new[i] && head[first[i]];
    if (admitted[i]) slot[i] = placed[first[i]];
    found[i] = found[i] && active[i];
  }
  return ffi::Error::Success();
}

// The first slot of lowest score among `size` slots from `base` (its score in `*low`).
inline int64_t LowestIn(const uint32_t* scores, int64_t base, int64_t size, uint32_t* low) {
  const uint32_t* s = scores + base;
  uint32_t least = UINT32_MAX;
  int64_t at = 0;
#if defined(__SSE2__)
  // The minimum four lanes at a time (SSE2 compares signed words: both sides' sign bits flipped),
  // then the first slot that holds it.
  const __m128i flip = _mm_set1_epi32(INT32_MIN);
  __m128i lanes = _mm_set1_epi32(INT32_MAX);  // UINT32_MAX, flipped
  for (; at + 4 <= size; at += 4) {
    const __m128i v = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + at)), flip);
    const __m128i lower = _mm_cmpgt_epi32(lanes, v);
    lanes = _mm_or_si128(_mm_and_si128(lower, v), _mm_andnot_si128(lower, lanes));
  }
  alignas(16) uint32_t lane[4];
  _mm_store_si128(reinterpret_cast<__m128i*>(lane), _mm_xor_si128(lanes, flip));
  least = std::min(std::min(lane[0], lane[1]), std::min(lane[2], lane[3]));
#endif
  for (int64_t rest = at; rest < size; ++rest) least = std::min(least, s[rest]);
  *low = least;
  at = 0;
#if defined(__SSE2__)
  const __m128i target = _mm_set1_epi32(static_cast<int32_t>(least));
  for (; at + 4 <= size; at += 4) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + at));
    const int m = _mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(v, target)));
    if (m) return base + at + __builtin_ctz(m);
  }
#endif
  for (; s[at] != least; ++at) {
  }
  return base + at;
}

// Each bucket's lowest score and its first slot (LowestIn), kept from the round that read them until
// a write to the bucket's scores: the rows of a round that share a bucket, and the later rounds
// that read a bucket no winner wrote, scan its scores once. Keyed by bucket in a table sized by
// the batch (a row reads two buckets), never by the capacity.
class BucketLows {
 public:
  BucketLows(const uint32_t* scores, int64_t bucket_size, int64_t rows)
      : scores_(scores), bucket_size_(bucket_size), cells_(ScratchSize(rows, 4)) {}

  // Whether `bucket`'s lowest score is known (its scores need not be fetched).
  bool Known(int64_t bucket) const {
    const Cell& c = cells_[Find(bucket)];
    return c.bucket == bucket && c.fresh;
  }

  // eviction._lowest: the first slot of lowest score in buckets `a` then `b` (a tie goes to `a`).
  int64_t Lowest(int64_t a, int64_t b, uint32_t* score) {
    const Cell &low_a = Read(a), &low_b = Read(b);
    *score = low_b.low < low_a.low ? low_b.low : low_a.low;
    return low_b.low < low_a.low ? low_b.best : low_a.best;
  }

  // `bucket`'s scores changed: read them again when next asked.
  void Forget(int64_t bucket) {
    Cell& c = cells_[Find(bucket)];
    if (c.bucket == bucket) c.fresh = false;
  }

 private:
  struct Cell {
    int64_t bucket = -1, best = 0;
    uint32_t low = 0;
    bool fresh = false;
  };
  int64_t Find(int64_t bucket) const {  // its cell, or the empty cell where it goes (linear probing)
    const int64_t mask = static_cast<int64_t>(cells_.size()) - 1;
    int64_t at = static_cast<int64_t>((static_cast<uint64_t>(bucket) * 0x9E3779B97F4A7C15ull) >> 40) & mask;
    while (cells_[at].bucket != bucket && cells_[at].bucket >= 0) at = (at + 1) & mask;
    return at;
  }
  const Cell& Read(int64_t bucket) {
    Cell& c = cells_[Find(bucket)];
    if (c.bucket != bucket || !c.fresh) {
      c.bucket = bucket;
      c.best = LowestIn(scores_, bucket * bucket_size_, bucket_size_, &c.low);
      c.fresh = true;
    }
    return c;
  }
  const uint32_t* scores_;
  int64_t bucket_size_;
  std::vector<Cell> cells_;
};

// eviction.evict: the keys of the `pending` rows (distinct new keys of a full table) take the slot
// of the entry of lowest score of their two buckets where it scores below them, in rounds of the
// lowest `m` pending rows. `named` (int32[n], or int32[0] for none): slots no key evicts.
ffi::Error Evict(ffi::Buffer<ffi::U32> digests_in, ffi::Buffer<ffi::U32> keys_in, ffi::Buffer<ffi::U32> overflow_in,
                 ffi::Buffer<ffi::U32> scores_in, ffi::Buffer<ffi::U32> words_in, ffi::Buffer<ffi::PRED> pending_in,
                 ffi::Buffer<ffi::U32> new_score_in, ffi::Buffer<ffi::S32> named_in,
                 ffi::ResultBuffer<ffi::U32> digests_out, ffi::ResultBuffer<ffi::U32> keys_out,
                 ffi::ResultBuffer<ffi::U32> overflow_out, ffi::ResultBuffer<ffi::U32> scores_out,
                 ffi::ResultBuffer<ffi::S32> slot_out, ffi::ResultBuffer<ffi::PRED> placed_out,
                 ffi::ResultBuffer<ffi::PRED> refused_out, ffi::ResultBuffer<ffi::PRED> displaced_out,
                 ffi::ResultBuffer<ffi::S32> victim_batch_out, ffi::ResultBuffer<ffi::U32> victim_words_out,
                 ffi::ResultBuffer<ffi::U32> victim_score_out, int64_t bucket_size) {
  Writable t{reinterpret_cast<uint8_t*>(InPlace(digests_in, digests_out)), InPlace(keys_in, keys_out),
             InPlace(overflow_in, overflow_out), overflow_in.dimensions()[0], bucket_size, keys_in.dimensions()[1]};
  uint32_t* scores = InPlace(scores_in, scores_out);
  if (words_in.dimensions().size() != 2 || words_in.dimensions()[1] != t.num_words) {
    return ffi::Error::InvalidArgument("jaxres_lean_evict: expected key rows as wide as the table's keys");
  }
  const int64_t n = words_in.dimensions()[0], W = t.num_words, nb = t.num_buckets;
  const uint32_t *words = words_in.typed_data(), *new_score = new_score_in.typed_data();
  const bool* pending = pending_in.typed_data();
  int32_t* slot = slot_out->typed_data();
  bool* placed = placed_out->typed_data();
  bool* refused = refused_out->typed_data();
  bool* displaced = displaced_out->typed_data();
  int32_t* victim_batch = victim_batch_out->typed_data();
  uint32_t* victim_words = victim_words_out->typed_data();
  uint32_t* victim_score = victim_score_out->typed_data();
  std::fill(slot, slot + n, 0);
  std::fill(placed, placed + n, false);
  std::fill(refused, refused + n, false);
  std::fill(displaced, displaced + n, false);
  std::fill(victim_batch, victim_batch + n, -1);
  std::fill(victim_words, victim_words + n * W, 0u);
  std::fill(victim_score, victim_score + n, 0u);
  if (n == 0) return ffi::Error::Success();
  const bool protect = named_in.dimensions()[0] == n;
  const int32_t* named = named_in.typed_data();
  constexpr uint32_t kNoScore = UINT32_MAX;
  std::vector<uint32_t> named_scores;
  if (protect) {  // read before the masking writes, written back after the rounds
    named_scores.resize(n);
    for (int64_t i = 0; i < n; ++i) named_scores[i] = scores[std::max(named[i], 0)];
    for (int64_t i = 0; i < n; ++i) {
      if (named[i] >= 0) scores[named[i]] = kNoScore;
    }
  }
  const Slots view = t.View();
  std::vector<int64_t> queue, rest, candidate, first(n), second(n);
  std::vector<uint32_t> digest(n), low;
  std::vector<char> won;
  for (int64_t i = 0; i < n; ++i) {
    if (!pending[i]) continue;
    view.BucketsOf(words + i * W, &first[i], &second[i], &digest[i]);
    queue.push_back(i);
  }
  const int64_t m = std::min(n, std::max<int64_t>(kChunkMinRows, kLeanRowsPerBucket * nb));
  BucketLows lows(scores, bucket_size, std::max<int64_t>(queue.size(), 1));
  Claims claims;
  for (int32_t rounds = 0; !queue.empty(); ++rounds) {
    const int64_t r = std::min<int64_t>(m, queue.size());
    candidate.resize(r);
    low.resize(r);
    for (int64_t p = 0; p < r; ++p) {
      const int64_t i = queue[p];
      if (p + kAhead < r) {  // the scores of both buckets of the row kAhead on, unless known
        const int64_t ahead = queue[p + kAhead], bytes = bucket_size * sizeof(uint32_t);
        for (const int64_t bucket : {first[ahead], second[ahead]}) {
          if (!lows.Known(bucket)) PrefetchRow(reinterpret_cast<const char*>(scores + bucket * bucket_size), bytes);
        }
      }
      const int64_t victim = lows.Lowest(first[i], second[i], &low[p]);
      candidate[p] = low[p] < new_score[i] ? victim : -1;
    }
    claims.Settle(candidate, rounds, ScratchSize(m), won);
    rest.clear();
    for (int64_t p = 0; p < r; ++p) {
      const int64_t i = queue[p], victim = candidate[p];
      if (victim < 0) {
        refused[i] = true;
      } else if (won[p]) {
        const uint32_t* old = t.keys + victim * W;
        int64_t victim_first, victim_second;
        uint32_t unused;
        view.BucketsOf(old, &victim_first, &victim_second, &unused);
        const int64_t bucket = victim / bucket_size;
        if (bucket != victim_first && bucket != victim_second) t.ShiftOverflow(victim_first, victim, ~0u);
        std::memcpy(victim_words + i * W, old, W * sizeof(uint32_t));
        t.Store(victim, words + i * W, digest[i]);
        scores[victim] = new_score[i];
        lows.Forget(bucket);
        slot[i] = static_cast<int32_t>(victim);
        placed[i] = true;
        victim_score[i] = low[p];
      } else {
        rest.push_back(i);
      }
    }
    rest.insert(rest.end(), queue.begin() + r, queue.end());
    queue.swap(rest);
  }
  if (!protect) return ffi::Error::Success();  // every key of the call scores the highest: none evicts another
  for (int64_t i = 0; i < n; ++i) {
    if (named[i] >= 0) scores[named[i]] = named_scores[i];
  }
  // eviction._displacements: a row whose victim's key is a key this call placed displaced that row.
  std::vector<int32_t> owner(2 * n);
  std::vector<uint32_t> both(2 * n * W);
  std::unique_ptr<bool[]> mask(new bool[2 * n]);
  std::memcpy(both.data(), words, n * W * sizeof(uint32_t));
  std::memcpy(both.data() + n * W, victim_words, n * W * sizeof(uint32_t));
  for (int64_t i = 0; i < n; ++i) mask[i] = mask[n + i] = placed[i];
  OwnerPerKey(both.data(), 2 * n, W, mask.get(), false, owner.data());
  for (int64_t i = 0; i < n; ++i) {
    if (placed[i] && owner[n + i] < n) victim_batch[i] = owner[n + i];
  }
  for (int64_t i = 0; i < n; ++i) {
    if (victim_batch[i] >= 0) displaced[victim_batch[i]] = true;
  }
  for (int64_t i = 0; i < n; ++i) placed[i] = placed[i] && !displaced[i];
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxresLeanUpsert, jaxres::lean::Upsert,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::PRED>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::PRED>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::PRED>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Attr<int64_t>("bucket_size")
                                  .Attr<int64_t>("capacity"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxresLeanEvict, jaxres::lean::Evict,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::PRED>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::PRED>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::PRED>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::PRED>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Attr<int64_t>("bucket_size"));

JAXRES_REGISTER_KERNEL("jaxres_lean_locate", JaxresLeanLocate);
JAXRES_REGISTER_KERNEL("jaxres_lean_lookup", JaxresLeanLookup);
JAXRES_REGISTER_KERNEL("jaxres_lean_upsert", JaxresLeanUpsert);
JAXRES_REGISTER_KERNEL("jaxres_lean_evict", JaxresLeanEvict);
