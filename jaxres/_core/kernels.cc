// CPU kernels of the open-addressing table, registered with XLA's FFI.
//
// Each kernel computes exactly what its pure-XLA counterpart in the Python
// package computes (the XLA code is the reference and the GPU/TPU path):
//
//   jaxres_locate     OpenAddressingTable._locate     (open_addressing.py)
//   jaxres_lookup     OpenAddressingTable._lookup_rows (open_addressing.py)
//   jaxres_search     SortedTable._search              (sorted_table.py)
//   jaxres_owner      claims.owner_per_key            (claims.py)
//   jaxres_upsert     placing.upsert_slots            (placing.py)
//   jaxres_prefix_sum claims.prefix_sum               (claims.py)
//   jaxres_evict      evicting.evict                  (evicting.py)
//   jaxres_read_rows  rows.read_rows                  (rows.py)
//   jaxres_write_rows rows.write_rows                 (rows.py)
//   jaxres_take_rows  rows.take_rows                  (rows.py)
//   jaxres_group_sums batch.group_sums                (batch.py)
//
// The XLA versions work in data-parallel rounds; these run the same rounds
// one row at a time, without the per-op overhead of XLA:CPU, with software
// prefetching of the bucket records. The read-only kernels (locate, lookup,
// search) split their rows over XLA's intra-op thread pool; every row is
// computed by exactly one thread from inputs no thread writes, so results
// never depend on scheduling. The upsert and evict kernels run their rounds on
// one thread.

#include <Python.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// ------------------------------------------------------------- threads

// Runs body(begin, end) over [0, n) split into equal ranges of at least
// `grain` rows (multiples of `align`), one per thread of `pool` at most. The
// calling thread takes ranges too, so this finishes even when no pool thread
// is free; a pool task that starts after every range is taken does nothing.
template <typename Body>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, int64_t grain, int64_t align, const Body& body) {
  const int64_t ranges = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), n / grain);
  if (ranges <= 1) {
    body(int64_t{0}, n);
    return;
  }
  const int64_t step = ((n + ranges - 1) / ranges + align - 1) / align * align;  // ranges * step >= n
  struct Progress {
    std::atomic<int64_t> next{0};
    int64_t done = 0;
    std::mutex mutex;
    std::condition_variable finished;
  };
  auto progress = std::make_shared<Progress>();
  // Takes ranges until none is left; `body` is only called on a range the caller still waits for.
  auto work = [progress, n, step, ranges, &body] {
    for (int64_t r; (r = progress->next.fetch_add(1)) < ranges;) {
      if (r * step < n) body(r * step, std::min(n, (r + 1) * step));
      std::lock_guard<std::mutex> lock(progress->mutex);
      if (++progress->done == ranges) progress->finished.notify_all();
    }
  };
  for (int64_t t = 1; t < ranges; ++t) pool.Schedule([work] { work(); });
  work();
  std::unique_lock<std::mutex> lock(progress->mutex);
  progress->finished.wait(lock, [&] { return progress->done == ranges; });
}

// ------------------------------------------------------------- hashing.py

inline uint32_t Rotl(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

inline uint32_t HashWords(const uint32_t* w, int64_t num_words, uint32_t seed) {
  uint32_t h = seed;
  for (int64_t j = 0; j < num_words; ++j) {
    uint32_t k = Rotl(w[j] * 0xCC9E2D51u, 15) * 0x1B873593u;
    h = Rotl(h ^ k, 13) * 5u + 0xE6546B64u;
  }
  h ^= static_cast<uint32_t>(num_words);
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

inline bool SameWords(const uint32_t* a, const uint32_t* b, int64_t num_words) {
  for (int64_t j = 0; j < num_words; ++j) {
    if (a[j] != b[j]) return false;
  }
  return true;
}

// Bit s set where slot s of a record holds `words` (occupied or not): branch
// free, as the matching slot is unpredictable; unrolled for common shapes.
template <int kWords, int kSlots>
inline uint32_t EqualSlots(const uint32_t* record, const uint32_t* words) {
  uint32_t equal = 0;
  for (int s = 0; s < kSlots; ++s) {
    uint32_t same = 1;
    for (int j = 0; j < kWords; ++j) same &= record[s * kWords + j] == words[j];
    equal |= same << s;
  }
  return equal;
}

#if defined(__SSE2__)
// The default shape (int64 keys, 4 slots) in two 128-bit compares: a slot matches where both
// of its words do.
template <>
inline uint32_t EqualSlots<2, 4>(const uint32_t* record, const uint32_t* words) {
  uint64_t key;
  std::memcpy(&key, words, sizeof(key));
  const __m128i k = _mm_set1_epi64x(static_cast<long long>(key));
  __m128i low = _mm_cmpeq_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(record)), k);
  __m128i high = _mm_cmpeq_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(record + 4)), k);
  low = _mm_and_si128(low, _mm_shuffle_epi32(low, _MM_SHUFFLE(2, 3, 0, 1)));
  high = _mm_and_si128(high, _mm_shuffle_epi32(high, _MM_SHUFFLE(2, 3, 0, 1)));
  return static_cast<uint32_t>(_mm_movemask_pd(_mm_castsi128_pd(low)) |
                               _mm_movemask_pd(_mm_castsi128_pd(high)) << 2);
}
#endif

// Exact `a % d` and `a / d` of 32-bit `a` by a divisor fixed per call,
// without a division instruction (Lemire, Kaser and Kurz, "Faster remainder by
// direct computation", 2019).
struct Divisor {
  uint64_t m;
  uint32_t d;
  Divisor() : Divisor(1) {}
  explicit Divisor(uint32_t d) : m(~uint64_t{0} / d + 1), d(d) {}
  uint32_t mod(uint32_t a) const { return static_cast<uint32_t>((static_cast<unsigned __int128>(m * a) * d) >> 64); }
  uint32_t div(uint32_t a) const {
    return d == 1 ? a : static_cast<uint32_t>((static_cast<unsigned __int128>(m) * a) >> 64);
  }
};

// Divisors 1..32: the numbers of free slots a bucket can have.
const Divisor* SmallDivisors() {
  static const auto* table = [] {
    auto* t = new Divisor[33];
    for (uint32_t d = 1; d <= 32; ++d) t[d] = Divisor(d);
    return t;
  }();
  return table;
}

// --------------------------------------------------------------- buckets.py

// The shape of a table's records: key words per slot and slots per bucket. The common shapes
// are compile-time constants (so hashing, comparing and slot arithmetic unroll); others are
// read from the call (Shape<0, 0>).
template <int kWords, int kSlots>
struct Shape {
  static constexpr int64_t num_words = kWords, bucket_size = kSlots;
  Shape(int64_t, int64_t) {}
};

template <>
struct Shape<0, 0> {
  int64_t num_words, bucket_size;
  Shape(int64_t words, int64_t slots) : num_words(words), bucket_size(slots) {}
};

// A view of the bucket records: per bucket, the key words of its slots, an
// occupancy bitmask, an overflow count and the value row of each slot, then
// padding up to `width` words.
template <int kWords, int kSlots>
struct Buckets : Shape<kWords, kSlots> {
  using Shape<kWords, kSlots>::num_words;
  using Shape<kWords, kSlots>::bucket_size;
  uint32_t* records;
  int64_t num_buckets, width;
  Divisor by_buckets, by_size;

  Buckets(uint32_t* records, const ffi::Span<const int64_t> dims, int64_t slots, int64_t words)
      : Shape<kWords, kSlots>(words, slots),
        records(records),
        num_buckets(dims[0]),
        width(dims[1]),
        by_buckets(dims[0]),
        by_size(slots) {}

  uint32_t* record(int64_t b) const { return records + b * width; }
  uint32_t& mask(int64_t b) const { return record(b)[bucket_size * num_words]; }
  uint32_t& overflow(int64_t b) const { return record(b)[bucket_size * num_words + 1]; }
  uint32_t& row(int64_t b, int64_t s) const { return record(b)[bucket_size * num_words + 2 + s]; }
  int64_t home(const uint32_t* words) const {
    return by_buckets.mod(HashWords(words, num_words, 0));
  }

  // Offset of the occupied slot of bucket `b` holding `words`, or -1.
  int64_t match(int64_t b, const uint32_t* words) const {
    const uint32_t equal = matches(b, words);
    return equal ? __builtin_ctz(equal) : -1;
  }

  // Bit s set where slot s of bucket `b` is occupied and holds `words` (at most one bit).
  uint32_t matches(int64_t b, const uint32_t* words) const {
    const uint32_t* r = record(b);
    uint32_t equal = 0;
    if constexpr (kWords > 0) {
      equal = EqualSlots<kWords, kSlots>(r, words);
    } else {
      for (int64_t s = 0; s < bucket_size; ++s) equal |= uint32_t{SameWords(r + s * num_words, words, num_words)} << s;
    }
    return equal & r[bucket_size * num_words];
  }

  void store(int64_t slot, const uint32_t* words) const {
    int64_t b = bucket_of(slot), s = slot - b * bucket_size;
    std::memcpy(record(b) + s * num_words, words, num_words * sizeof(uint32_t));
    mask(b) += 1u << s;
  }

  int64_t bucket_of(int64_t slot) const {
    if constexpr (kSlots > 0) return static_cast<uint32_t>(slot) / kSlots;
    return by_size.div(static_cast<uint32_t>(slot));
  }
  int64_t next(int64_t b) const { return b + 1 == num_buckets ? 0 : b + 1; }
  // Buckets from `home` forward to `b` (wrapping).
  int64_t distance(int64_t home, int64_t b) const { return b >= home ? b - home : b - home + num_buckets; }

  // The cache lines of a record's used words.
  void prefetch(int64_t b) const {
    const uint32_t* first = record(b);
    const uint32_t* last = first + bucket_size * (num_words + 1) + 1;
    __builtin_prefetch(first);
    if ((reinterpret_cast<uintptr_t>(first) ^ reinterpret_cast<uintptr_t>(last)) >> 6) __builtin_prefetch(last);
  }
};

// Calls body(t) with the view `t` of records [num_buckets, width] of keys of `num_words` words,
// its shape a compile-time constant where it is one of the defaults (see line_slots in
// open_addressing.py: 7 slots for 1-word keys, 4 for 2-word keys; 8 for an evicting table).
template <typename Body>
ffi::Error WithBuckets(uint32_t* records, const ffi::Span<const int64_t> dims, int64_t bucket_size,
                       int64_t num_words, const Body& body) {
  if (num_words == 2 && bucket_size == 4) return body(Buckets<2, 4>(records, dims, bucket_size, num_words));
  if (num_words == 1 && bucket_size == 7) return body(Buckets<1, 7>(records, dims, bucket_size, num_words));
  if (num_words == 2 && bucket_size == 8) return body(Buckets<2, 8>(records, dims, bucket_size, num_words));
  if (num_words == 1 && bucket_size == 8) return body(Buckets<1, 8>(records, dims, bucket_size, num_words));
  return body(Buckets<0, 0>(records, dims, bucket_size, num_words));
}

constexpr int64_t kAhead = 32;  // rows whose home bucket is fetched ahead of the probe

// ------------------------------------------------------------ claims.py

// Rows handled per round of a loop that only rare rows enter.
int64_t ChunkSize(int64_t n) { return std::min(n, std::max<int64_t>(64, n / 8)); }

int BitLength(uint64_t x) { return x ? 64 - __builtin_clzll(x) : 0; }

// Set bits of x, inline (__builtin_popcount is a library call where the target lacks popcnt).
inline int BitCount(uint32_t x) {
  x = x - ((x >> 1) & 0x55555555u);
  x = (x & 0x33333333u) + ((x >> 2) & 0x33333333u);
  return static_cast<int>((((x + (x >> 4)) & 0x0F0F0F0Fu) * 0x01010101u) >> 24);
}

// Scratch cells for a batch of `n` rows (a power of two).
int64_t ScratchSize(int64_t n) { return int64_t{1} << std::max(1, BitLength(8 * n - 1)); }

inline int64_t CellOf(int32_t slot, int32_t rounds, int64_t size) {
  uint32_t mixed = (static_cast<uint32_t>(slot) ^ (static_cast<uint32_t>(rounds) * 0x85EBCA6Bu)) * 0x9E3779B1u;
  return mixed >> (33 - BitLength(size));
}

// For rows `0..n-1` writing `cells` where `mask`: the lowest writer of each
// row's cell (n-1 where none), as claims.lowest_writer.
void LowestWriter(const std::vector<int64_t>& cells, const std::vector<char>& mask, int64_t size,
                  std::vector<int32_t>& scratch, std::vector<int32_t>& writer) {
  int64_t n = cells.size();
  constexpr int32_t kFree = INT32_MAX;
  scratch.assign(size, kFree);
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) __builtin_prefetch(&scratch[cells[i + kAhead]], 1);
    if (mask[i]) scratch[cells[i]] = std::min<int32_t>(scratch[cells[i]], i);
  }
  writer.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) __builtin_prefetch(&scratch[cells[i + kAhead]]);
    writer[i] = std::min<int32_t>(scratch[cells[i]], n - 1);
  }
}

// For each masked row, the first (or last) masked row with the same words;
// unmasked rows get their own index. A hash map from words to rows.
void OwnerPerKey(const uint32_t* words, int64_t n, int64_t num_words, const bool* mask, bool last,
                 int32_t* owner) {
  int64_t size = int64_t{1} << std::max(1, BitLength(2 * n));
  std::vector<int32_t> map(size, -1);
  for (int64_t k = 0; k < n; ++k) {
    int64_t i = last ? n - 1 - k : k;
    owner[i] = i;
    if (!mask[i]) continue;
    const uint32_t* w = words + i * num_words;
    for (int64_t c = HashWords(w, num_words, 0x0C1A) & (size - 1);; c = (c + 1) & (size - 1)) {
      if (map[c] < 0) {
        map[c] = i;
        break;
      }
      if (SameWords(words + map[c] * num_words, w, num_words)) {
        owner[i] = map[c];
        break;
      }
    }
  }
}

// -------------------------------------------------------- probes and rows

// Where `key` is, probing from its `home` bucket: true if present, with its slot and value
// row; for a miss, the first slot of its home bucket (as the XLA probe reports) and row 0.
// Branch free on the common path (the home bucket holds the key, or never overflowed), as
// hits and misses come unpredictably.
template <typename Table>
inline bool Probe(const Table& t, const uint32_t* key, int64_t home, int32_t* slot, int32_t* row) {
  const uint32_t equal = t.matches(home, key);
  int64_t b = home, s = equal ? __builtin_ctz(equal) : -1;
  if (__builtin_expect(!equal && t.overflow(home) > 0, 0)) {
    for (int64_t step = 1; s < 0 && t.overflow(b) > 0 && step <= t.num_buckets; ++step) {
      b = t.next(b);
      s = t.match(b, key);
    }
  }
  const int64_t at = s < 0 ? 0 : s;
  const uint32_t value_row = t.row(b, at);
  *slot = static_cast<int32_t>((s < 0 ? home : b) * t.bucket_size + at);
  *row = s < 0 ? 0 : static_cast<int32_t>(value_row);
  return s >= 0;
}

// The home buckets of `n` key rows `w`, hashed and prefetched kAhead rows before the probe
// reads them (in a ring, so the hashing overlaps the memory reads it waits for).
template <typename Table>
class HomesAhead {
 public:
  HomesAhead(const Table& t, const uint32_t* w, int64_t n) : t_(t), w_(w), n_(n) {
    for (int64_t k = 0; k < std::min(n, kAhead); ++k) Fetch(k);
  }
  // Row k's home bucket; fetches row k + kAhead's.
  int64_t Next(int64_t k) {
    if (k + kAhead < n_) Fetch(k + kAhead);
    return home_[k % kRing];
  }

 private:
  static constexpr int64_t kRing = 2 * kAhead;
  void Fetch(int64_t k) {
    home_[k % kRing] = t_.home(w_ + k * t_.num_words);
    t_.prefetch(home_[k % kRing]);
  }
  const Table& t_;
  const uint32_t* w_;
  int64_t n_, home_[kRing];
};

// OpenAddressingTable._locate: whether each of the `n` key rows is present, and its slot.
template <typename Table>
void LocateRows(const Table& t, const uint32_t* w, int64_t n, bool* hit, int32_t* out) {
  HomesAhead homes(t, w, n);
  int32_t row;
  for (int64_t i = 0; i < n; ++i) hit[i] = Probe(t, w + i * t.num_words, homes.Next(i), out + i, &row);
}

// Bytes of one row (the leading axis) of `buffer`.
int64_t RowBytes(const ffi::AnyBuffer& buffer) {
  auto dims = buffer.dimensions();
  int64_t bytes = ffi::ByteWidth(buffer.element_type());
  for (size_t d = 1; d < dims.size(); ++d) bytes *= dims[d];
  return bytes;
}

inline void CopyRow(char* to, const char* from, int64_t bytes) {
  switch (bytes) {  // the common widths as single moves
    case 4:
      std::memcpy(to, from, 4);
      break;
    case 8:
      std::memcpy(to, from, 8);
      break;
    default:
      std::memcpy(to, from, bytes);
  }
}

inline void PrefetchRow(const char* row, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(row + at);
  __builtin_prefetch(row + bytes - 1);
}

// ------------------------------------------------------------------ kernels

constexpr int64_t kGrain = 8192;  // rows below which a thread of its own does not pay (measured)

ffi::Error Locate(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> records, ffi::Buffer<ffi::U32> words,
                  ffi::ResultBuffer<ffi::PRED> found, ffi::ResultBuffer<ffi::S32> slot, int64_t bucket_size) {
  const int64_t W = words.dimensions()[1];
  return WithBuckets(records.typed_data(), records.dimensions(), bucket_size, W, [&](const auto& t) {
    ParallelFor(pool, words.dimensions()[0], kGrain, 1, [&](int64_t begin, int64_t end) {
      LocateRows(t, words.typed_data() + begin * W, end - begin, found->typed_data() + begin,
                 slot->typed_data() + begin);
    });
    return ffi::Error::Success();
  });
}

// A value leaf of a lookup: rows are read from `from` (a hit) or `fallback` (a miss: its
// row i at i * fallback_step, one row for all where the step is 0) into `to`.
struct Column {
  const char *from, *fallback;
  char* to;
  int64_t bytes, fallback_step;
};

// Row i's value of one column, copied branch free (the source address is a select): kBytes is
// the row's width where known at compile time, else 0.
template <int64_t kBytes>
inline void CopyValue(const Column& c, int64_t i, bool hit, int32_t row) {
  const int64_t bytes = kBytes > 0 ? kBytes : c.bytes;
  const char* source = hit ? c.from + row * bytes : c.fallback + i * c.fallback_step;
  std::memcpy(c.to + i * bytes, source, bytes);
}

// OpenAddressingTable._lookup_rows over rows [begin, end): one pass, where a row's record is
// fetched kAhead rows ahead of its probe and its value rows kLag rows ahead of their copy, so
// both kinds of reads overlap. kBytes (4 or 8) > 0: a single column of rows that wide.
template <int64_t kBytes, typename Table>
void LookupRows(const Table& t, const uint32_t* w, int64_t begin, int64_t end, const std::vector<Column>& columns,
                bool* hit) {
  constexpr int64_t kLag = 16;
  const int64_t len = end - begin, num_columns = kBytes > 0 ? 1 : columns.size();
  HomesAhead homes(t, w + begin * t.num_words, len);
  int32_t row[kLag], slot;  // the value rows of the last kLag rows probed
  for (int64_t k = 0; k < len + kLag; ++k) {
    if (k >= kLag) {
      const int64_t i = begin + k - kLag;
      for (int64_t c = 0; c < num_columns; ++c) CopyValue<kBytes>(columns[c], i, hit[i], row[k % kLag]);
    }
    if (k < len) {
      const int64_t i = begin + k;
      hit[i] = Probe(t, w + i * t.num_words, homes.Next(k), &slot, &row[k % kLag]);
      for (int64_t c = 0; c < num_columns; ++c) {
        if (kBytes > 0) {  // 4 or 8 bytes: within one cache line
          __builtin_prefetch(columns[c].from + row[k % kLag] * kBytes);
        } else {
          PrefetchRow(columns[c].from + row[k % kLag] * columns[c].bytes, columns[c].bytes);
        }
      }
    }
  }
}

// Arguments after `words`: the value leaves [rows, ...], then as many
// default leaves, [n, ...] or one row for all; results after `found`: the
// values [n, ...], each row its slot's value row where found, else its default.
ffi::Error Lookup(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> records, ffi::Buffer<ffi::U32> words,
                  ffi::RemainingArgs leaves, ffi::ResultBuffer<ffi::PRED> found, ffi::RemainingRets outputs,
                  int64_t bucket_size) {
  const int64_t n = words.dimensions()[0], num_leaves = outputs.size();
  if (leaves.size() != static_cast<size_t>(2 * num_leaves)) {
    return ffi::Error::InvalidArgument("jaxres_lookup: expected a default leaf per value leaf");
  }
  std::vector<Column> columns;
  for (int64_t l = 0; l < num_leaves; ++l) {
    auto values = leaves.get<ffi::AnyBuffer>(l), defaults = leaves.get<ffi::AnyBuffer>(num_leaves + l);
    auto out = outputs.get<ffi::AnyBuffer>(l);
    if (!values || !defaults || !out) return ffi::Error::InvalidArgument("jaxres_lookup: bad leaf");
    const int64_t bytes = RowBytes(*values);
    columns.push_back({static_cast<const char*>(values->untyped_data()),
                       static_cast<const char*>(defaults->untyped_data()), static_cast<char*>((*out)->untyped_data()),
                       bytes, defaults->size_bytes() == static_cast<size_t>(n * bytes) ? bytes : 0});
  }
  const int64_t single = columns.size() == 1 ? columns[0].bytes : 0;
  bool* hit = found->typed_data();
  const int64_t W = words.dimensions()[1];
  return WithBuckets(records.typed_data(), records.dimensions(), bucket_size, W, [&](const auto& t) {
    auto rows = single == 4 ? LookupRows<4, std::decay_t<decltype(t)>>
                : single == 8 ? LookupRows<8, std::decay_t<decltype(t)>>
                              : LookupRows<0, std::decay_t<decltype(t)>>;
    ParallelFor(pool, n, kGrain, 1, [&](int64_t begin, int64_t end) {
      rows(t, words.typed_data(), begin, end, columns, hit);
    });
    return ffi::Error::Success();
  });
}

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
      __builtin_prefetch(keys + (base[g] + next_half) * W);
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

ffi::Error Owner(ffi::Buffer<ffi::U32> words, ffi::Buffer<ffi::PRED> mask, ffi::ResultBuffer<ffi::S32> owner,
                 bool last) {
  int64_t n = words.dimensions()[0], num_words = words.dimensions()[1];
  OwnerPerKey(words.typed_data(), n, num_words, mask.typed_data(), last, owner->typed_data());
  return ffi::Error::Success();
}

// claims.prefix_sum: the running total (wrapping, as XLA's int32 adds).
ffi::Error PrefixSum(ffi::Buffer<ffi::S32> x, ffi::ResultBuffer<ffi::S32> out) {
  uint32_t total = 0;
  for (size_t i = 0; i < x.element_count(); ++i) {
    total += static_cast<uint32_t>(x.typed_data()[i]);
    out->typed_data()[i] = static_cast<int32_t>(total);
  }
  return ffi::Error::Success();
}

// batch.admit: which new rows may insert when `room` more keys fit (the rows of the first
// `room` distinct new keys, by first occurrence); returns the number of new keys left out.
int64_t Admit(const uint32_t* words, int64_t n, int64_t W, const bool* is_new, int64_t room, bool* admitted) {
  std::vector<int32_t> owner(n);
  OwnerPerKey(words, n, W, is_new, false, owner.data());
  int64_t heads = 0, dropped = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!is_new[i]) {
      admitted[i] = false;
    } else if (owner[i] == i) {
      admitted[i] = heads++ < room;
      dropped += !admitted[i];
    } else {
      admitted[i] = admitted[owner[i]];
    }
  }
  return dropped;
}

// Offsets of the set bits of every byte: kByteBits.nth[b][k] is the k-th (from 0) of byte b's.
struct ByteBits {
  uint8_t count[256];
  uint8_t nth[256][8];
};

constexpr ByteBits MakeByteBits() {
  ByteBits bits{};
  for (int b = 0; b < 256; ++b) {
    for (int s = 0; s < 8; ++s) {
      if ((b >> s) & 1) bits.nth[b][bits.count[b]++] = static_cast<uint8_t>(s);
    }
  }
  return bits;
}

constexpr ByteBits kByteBits = MakeByteBits();

// The offset of the k-th (from 0) set bit of x, for k < BitCount(x); 0 where x is 0. Without a
// data-dependent branch for buckets of up to 8 slots.
inline int64_t NthSetBit(uint32_t x, int64_t k) {
  if (x == 0) return 0;
  int64_t base = 0;
  for (; k >= kByteBits.count[x & 0xFFu]; x >>= 8, base += 8) k -= kByteBits.count[x & 0xFFu];
  return base + kByteBits.nth[x & 0xFFu][k];
}

// placing.upsert_slots, round for round: locates the rows' keys, admits the new keys that
// fit, and places them by claims. Each round has two stages. The first reads the records
// as the round found them (rows split over the thread pool): in round 0 where each key is
// and the free slots of its home bucket, in later rounds each row's candidate slot. The
// second settles the claims one row at a time in increasing order, so the first claim of a
// scratch cell is its lowest writer (claims.lowest_writer); a winner stores its key and
// takes its value row at once. Round 0 lists its claimants without a branch per row, as
// found and new keys alternate at random. The overflow counts are raised at the end.
ffi::Error Upsert(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> records_in, ffi::Buffer<ffi::U32> words_in,
                  ffi::Buffer<ffi::PRED> active, ffi::Buffer<ffi::S32> free_rows, ffi::Buffer<ffi::S32> size_in,
                  ffi::ResultBuffer<ffi::U32> records_out, ffi::ResultBuffer<ffi::PRED> found_out,
                  ffi::ResultBuffer<ffi::S32> slot_out, ffi::ResultBuffer<ffi::PRED> admitted_out,
                  ffi::ResultBuffer<ffi::S32> dropped_out, ffi::ResultBuffer<ffi::S32> first_out,
                  ffi::ResultBuffer<ffi::S32> row_out, int64_t bucket_size) {
  uint32_t* records = records_out->typed_data();
  if (records != records_in.typed_data()) {
    std::memcpy(records, records_in.typed_data(), records_in.size_bytes());
  }
  const int64_t n = words_in.dimensions()[0];
  const int64_t capacity = free_rows.dimensions()[0], room = capacity - size_in.typed_data()[0];
  const uint32_t* words = words_in.typed_data();
  const bool* is_active = active.typed_data();
  bool* found = found_out->typed_data();
  bool* admitted = admitted_out->typed_data();
  int32_t* slot = slot_out->typed_data();
  int32_t* first = first_out->typed_data();
  int32_t* row = row_out->typed_data();
  dropped_out->typed_data()[0] = 0;
  if (n == 0) return ffi::Error::Success();
  return WithBuckets(records, records_in.dimensions(), bucket_size, words_in.dimensions()[1], [&](const auto& t) {
    const int64_t W = t.num_words, size = t.bucket_size;
    std::vector<int64_t> home(n), bucket(n);
    std::vector<uint32_t> lane(n);
    std::vector<char> pending(n), hit(n);  // hit: the key was in the table (its value row is known)
    // What the first stage finds for each position of a round.
    enum Outcome : char { kPlaced, kFull, kTrying };
    std::vector<char> outcome;
    std::vector<int32_t> candidate(n), cell(n), scratch;
    std::vector<int64_t> rows(n), queue;  // queue: the pending rows after a round, lowest first
    std::vector<int64_t> moved;  // winners placed past their home bucket
    int64_t taken = size_in.typed_data()[0];  // free_rows[taken] is the next new key's value row
    constexpr int32_t kFree = INT32_MAX;
    const Divisor* divisors = SmallDivisors();
    const uint32_t all_slots = size == 32 ? ~0u : (1u << size) - 1;

    // Stage two, for position p of a round whose claim is `trying`: the first claim of its
    // cell takes the slot (stores the key and takes a value row); a later claim of the same
    // slot by an equal key shares it; any other claim tries again in a later round.
    auto claim = [&](int64_t p) {
      const int64_t i = rows[p];
      const int32_t w = scratch[cell[p]];
      if (w == kFree) {
        scratch[cell[p]] = static_cast<int32_t>(p);
        const int64_t b = t.bucket_of(candidate[p]);
        t.store(candidate[p], words + i * W);
        row[i] = free_rows.typed_data()[std::clamp<int64_t>(taken++, 0, capacity - 1)];
        t.row(b, candidate[p] - b * size) = static_cast<uint32_t>(row[i]);
        if (b != home[i]) moved.push_back(i);
        slot[i] = candidate[p];
        pending[i] = 0;
      } else if (candidate[w] == candidate[p] && SameWords(words + rows[w] * W, words + i * W, W)) {
        slot[i] = candidate[p];  // its key's earlier row won the slot
        first[i] = static_cast<int32_t>(rows[w]);
        row[i] = row[rows[w]];
        pending[i] = 0;
      }
    };

    // Round 0, stage one: where each key is, and the free slots of its home bucket as the round
    // found them. Found and new keys come in random order, so this is branch free on the
    // common path; homes are hashed as their records are fetched.
    std::vector<uint32_t> free_slots(n);
    ParallelFor(pool, n, kGrain, 1, [&](int64_t begin, int64_t end) {
      HomesAhead homes(t, words + begin * W, end - begin);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t h = homes.Next(i - begin);
        home[i] = bucket[i] = h;
        hit[i] = Probe(t, words + i * W, h, slot + i, row + i);
        found[i] = hit[i] && is_active[i];
        free_slots[i] = ~t.mask(h) & all_slots;
      }
    });
    // Which new keys fit.
    int64_t num_new = 0;
    for (int64_t i = 0; i < n; ++i) {
      admitted[i] = is_active[i] && !hit[i];
      num_new += admitted[i];
    }
    if (num_new > room) {
      std::vector<char> is_new(admitted, admitted + n);
      dropped_out->typed_data()[0] =
          static_cast<int32_t>(Admit(words, n, W, reinterpret_cast<const bool*>(is_new.data()), room, admitted));
    }
    // The admitted rows, listed without a branch per row (admitted and found rows alternate at random).
    std::vector<int64_t> claimants(n);
    int64_t num_claimants = 0;
    for (int64_t i = 0; i < n; ++i) {
      rows[i] = i;
      first[i] = static_cast<int32_t>(i);
      pending[i] = admitted[i];
      claimants[num_claimants] = i;
      num_claimants += admitted[i];
    }
    // Round 0, stage two: each admitted row claims the free slot its lane picks (none, marked
    // -1: its bucket is full and it moves on to the next), in batch order, with the records and
    // scratch cells of the claims kAhead ahead fetched.
    const int64_t first_scratch = ScratchSize(n);
    ParallelFor(pool, num_claimants, kGrain, 1, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) {
        const int64_t i = claimants[j];
        lane[i] = (HashWords(words + i * W, W, 1) * 0x9E3779B1u) >> 16;
        const int64_t num_free = BitCount(free_slots[i]);
        if (__builtin_expect(num_free == 0, 0)) {
          candidate[i] = -1;
          bucket[i] = t.next(bucket[i]);
          continue;
        }
        const int64_t offset = NthSetBit(free_slots[i], divisors[num_free].mod(lane[i]));
        candidate[i] = static_cast<int32_t>(home[i] * size + offset);
        cell[i] = static_cast<int32_t>(CellOf(candidate[i], 0, first_scratch));
      }
    });
    scratch.assign(first_scratch, kFree);
    for (int64_t j = 0; j < num_claimants; ++j) {
      if (j + kAhead < num_claimants && candidate[claimants[j + kAhead]] >= 0) {
        t.prefetch(home[claimants[j + kAhead]]);
        __builtin_prefetch(&scratch[cell[claimants[j + kAhead]]], 1);
      }
      if (candidate[claimants[j]] >= 0) claim(claimants[j]);
    }
    for (int64_t j = 0; j < num_claimants; ++j) scratch[cell[claimants[j]]] = kFree;  // clean for later rounds
    for (int64_t i = 0; i < n; ++i) {
      if (pending[i]) queue.push_back(i);
    }

    // Later rounds: up to a chunk of the pending rows, lowest index first (claims.pending_rows),
    // with a scratch sized by the chunk as in the reference.
    const int64_t chunk = ChunkSize(n);
    for (int32_t rounds = 1; !queue.empty(); ++rounds) {
      const int64_t m = std::min<int64_t>(chunk, queue.size()), scratch_size = ScratchSize(chunk);
      rows.assign(queue.begin(), queue.begin() + m);
      queue.erase(queue.begin(), queue.begin() + m);
      outcome.assign(m, kTrying);
      candidate.assign(m, 0);
      cell.assign(m, 0);
      // Stage one: the row's candidate slot and scratch cell, from the records as the round found them.
      auto pick = [&](int64_t p) {
        const int64_t i = rows[p];
        const int64_t current = bucket[i];
        // An equal key of an earlier chunk may have been placed since.
        const int64_t s = t.match(current, words + i * W);
        if (s >= 0) {
          outcome[p] = kPlaced;
          candidate[p] = static_cast<int32_t>(current * size + s);
          row[i] = static_cast<int32_t>(t.row(current, s));
          return;
        }
        const uint32_t free = ~t.mask(current) & all_slots;
        const int64_t num_free = BitCount(free);
        if (num_free == 0) {
          outcome[p] = kFull;
          return;
        }
        outcome[p] = kTrying;
        candidate[p] = static_cast<int32_t>(current * size + NthSetBit(free, divisors[num_free].mod(lane[i])));
        cell[p] = static_cast<int32_t>(CellOf(candidate[p], rounds, scratch_size));
      };
      ParallelFor(pool, m, kGrain, 1, [&](int64_t begin, int64_t end) {
        for (int64_t p = begin; p < end; ++p) {
          if (p + kAhead < end) t.prefetch(bucket[rows[p + kAhead]]);
          pick(p);
        }
      });
      // Stage two: the claims settle, in order.
      for (int64_t p = 0; p < m; ++p) {
        const int64_t i = rows[p];
        switch (outcome[p]) {
          case kPlaced:
            slot[i] = candidate[p];
            first[i] = -1;  // placed by an equal key whose row is not known here (resolved below)
            pending[i] = 0;
            break;
          case kFull:
            bucket[i] = t.next(bucket[i]);
            break;
          case kTrying:
            claim(p);
        }
      }
      for (int64_t p = 0; p < m; ++p) scratch[cell[p]] = kFree;
      // Rows of this round still pending go before the queue's rest (all higher).
      std::vector<int64_t> requeue;
      for (int64_t p = 0; p < m; ++p) {
        if (pending[rows[p]]) requeue.push_back(rows[p]);
      }
      queue.insert(queue.begin(), requeue.begin(), requeue.end());
    }
    // Raise the overflow count of every bucket a newly placed key probed past.
    for (int64_t i : moved) {
      for (int64_t r = 0, h = home[i], d = t.distance(h, t.bucket_of(slot[i])); r < d; ++r, h = t.next(h)) {
        t.overflow(h) += 1u;
      }
    }
    // Rare: equal keys split over chunks. Each key's first row is then its slot's lowest row.
    if (std::any_of(first, first + n, [](int32_t f) { return f < 0; })) {
      std::vector<uint32_t> slot_words(slot, slot + n);
      OwnerPerKey(slot_words.data(), n, 1, admitted, false, first);
    }
    // The rows neither found nor placed read their slot's value row.
    auto unknown = [&](int64_t i) { return !admitted[i] && !hit[i]; };
    for (int64_t i = 0; i < n; ++i) {
      if (i + kAhead < n && unknown(i + kAhead)) t.prefetch(t.bucket_of(slot[i + kAhead]));
      if (unknown(i)) {
        const int64_t b = t.bucket_of(slot[i]);
        row[i] = static_cast<int32_t>(t.row(b, slot[i] - b * size));
      }
    }
    return ffi::Error::Success();
  });
}

// rows.read_rows: the rows `index` (clipped) of `leaf`, and `leaf` itself as an
// output (aliased: unchanged, in place), which the caller then writes into.
ffi::Error ReadRows(ffi::AnyBuffer leaf, ffi::Buffer<ffi::S32> index, ffi::Result<ffi::AnyBuffer> leaf_out,
                    ffi::Result<ffi::AnyBuffer> rows_out) {
  const char* from = static_cast<const char*>(leaf.untyped_data());
  if (leaf_out->untyped_data() != leaf.untyped_data()) {
    std::memcpy(leaf_out->untyped_data(), from, leaf.size_bytes());
  }
  const int64_t bytes = RowBytes(leaf), count = leaf.dimensions()[0], n = index.element_count();
  const int32_t* at = index.typed_data();
  char* to = static_cast<char*>(rows_out->untyped_data());
  auto row = [&](int64_t i) { return from + std::clamp<int64_t>(at[i], 0, count - 1) * bytes; };
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) PrefetchRow(row(i + kAhead), bytes);
    CopyRow(to + i * bytes, row(i), bytes);
  }
  return ffi::Error::Success();
}

// rows.write_rows: each leaf with row i of its `rows` written at index[i] where mask[i], in
// batch order, so that of the rows naming one index the last wins; indices outside the leaves
// are dropped. Arguments after the mask: the leaves, then as many row arrays [n, ...]; the
// leaves are updated in place (aliased), one pass over the batch for all of them.
ffi::Error WriteRows(ffi::Buffer<ffi::S32> index, ffi::Buffer<ffi::PRED> mask, ffi::RemainingArgs args,
                     ffi::RemainingRets outputs) {
  const int64_t num_leaves = outputs.size(), n = index.element_count();
  if (args.size() != static_cast<size_t>(2 * num_leaves) || mask.element_count() != static_cast<size_t>(n)) {
    return ffi::Error::InvalidArgument("jaxres_write_rows: expected a mask entry per index and rows per leaf");
  }
  struct Column {
    char* to;
    const char* from;
    int64_t bytes;
  };
  std::vector<Column> columns;
  int64_t count = 0;
  for (int64_t l = 0; l < num_leaves; ++l) {
    auto leaf = args.get<ffi::AnyBuffer>(l), rows = args.get<ffi::AnyBuffer>(num_leaves + l);
    auto out = outputs.get<ffi::AnyBuffer>(l);
    if (!leaf || !rows || !out) return ffi::Error::InvalidArgument("jaxres_write_rows: bad leaf");
    const int64_t bytes = RowBytes(*leaf);
    if (rows->size_bytes() != static_cast<size_t>(n * bytes)) {
      return ffi::Error::InvalidArgument("jaxres_write_rows: expected a row per index");
    }
    char* to = static_cast<char*>((*out)->untyped_data());
    if (to != leaf->untyped_data()) std::memcpy(to, leaf->untyped_data(), leaf->size_bytes());
    columns.push_back({to, static_cast<const char*>(rows->untyped_data()), bytes});
    count = leaf->dimensions()[0];
  }
  const int32_t* at = index.typed_data();
  const bool* write = mask.typed_data();
  auto inside = [&](int64_t i) { return write[i] && at[i] >= 0 && at[i] < count; };
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n && inside(i + kAhead)) {
      for (const Column& c : columns) __builtin_prefetch(c.to + at[i + kAhead] * c.bytes, 1);
    }
    if (!inside(i)) continue;
    for (const Column& c : columns) CopyRow(c.to + at[i] * c.bytes, c.from + i * c.bytes, c.bytes);
  }
  return ffi::Error::Success();
}

// rows.take_rows: the rows `index` (clipped) of `leaf`.
ffi::Error TakeRows(ffi::AnyBuffer leaf, ffi::Buffer<ffi::S32> index, ffi::Result<ffi::AnyBuffer> rows_out) {
  const char* from = static_cast<const char*>(leaf.untyped_data());
  const int64_t bytes = RowBytes(leaf), count = leaf.dimensions()[0], n = index.element_count();
  const int32_t* at = index.typed_data();
  char* to = static_cast<char*>(rows_out->untyped_data());
  auto row = [&](int64_t i) { return from + std::clamp<int64_t>(at[i], 0, count - 1) * bytes; };
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) PrefetchRow(row(i + kAhead), bytes);
    CopyRow(to + i * bytes, row(i), bytes);
  }
  return ffi::Error::Success();
}

// The rows 0..n-1 with key[i] >= 0, stably sorted by key: radix passes of 11 bits, as many as
// the largest key needs.
std::vector<int32_t> SortedRows(const int32_t* key, int64_t n) {
  constexpr int kBits = 11;
  std::vector<int32_t> rows, passed;
  rows.reserve(n);
  int32_t largest = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (key[i] < 0) continue;
    rows.push_back(static_cast<int32_t>(i));
    largest = std::max(largest, key[i]);
  }
  passed.resize(rows.size());
  std::vector<int32_t> start(1 << kBits);
  for (int shift = 0; shift == 0 || (largest >> shift) > 0; shift += kBits) {
    std::fill(start.begin(), start.end(), 0);
    for (int32_t r : rows) ++start[(key[r] >> shift) & ((1 << kBits) - 1)];
    int32_t total = 0;
    for (auto& c : start) total += std::exchange(c, total);
    for (int32_t r : rows) passed[start[(key[r] >> shift) & ((1 << kBits) - 1)]++] = r;
    rows.swap(passed);
  }
  return rows;
}

// batch.group_sums: the distinct groups >= 0 in ascending order (-1 after them), and for each
// the sum of its rows of x as the same balanced tree over its rows in batch order.
template <typename T>
void GroupSumsOf(const int32_t* group, const T* x, int64_t n, int64_t width, int32_t* groups, T* sums) {
  const std::vector<int32_t> rows = SortedRows(group, n);
  std::vector<T> partial;
  int64_t out = 0;
  for (size_t begin = 0, end; begin < rows.size(); begin = end, ++out) {
    for (end = begin + 1; end < rows.size() && group[rows[end]] == group[rows[begin]];) ++end;
    const int64_t length = end - begin;
    groups[out] = group[rows[begin]];
    T* sum = sums + out * width;
    if (length == 1) {
      std::memcpy(sum, x + rows[begin] * width, width * sizeof(T));
      continue;
    }
    partial.resize(length * width);
    for (int64_t r = 0; r < length; ++r) {
      std::memcpy(&partial[r * width], x + rows[begin + r] * width, width * sizeof(T));
    }
    for (int64_t step = 1; step < length; step *= 2) {
      for (int64_t r = 0; r + step < length; r += 2 * step) {
        T* into = &partial[r * width];
        const T* other = &partial[(r + step) * width];
        for (int64_t j = 0; j < width; ++j) into[j] = into[j] + other[j];
      }
    }
    std::memcpy(sum, partial.data(), width * sizeof(T));
  }
  std::fill(groups + out, groups + n, -1);
  std::fill(sums + out * width, sums + n * width, T(0));
}

ffi::Error GroupSums(ffi::Buffer<ffi::S32> group, ffi::AnyBuffer x, ffi::ResultBuffer<ffi::S32> groups,
                     ffi::Result<ffi::AnyBuffer> sums) {
  const int64_t n = group.element_count(), width = n ? x.element_count() / n : 0;
  switch (x.element_type()) {
    case ffi::DataType::F32:
      GroupSumsOf(group.typed_data(), x.typed_data<float>(), n, width, groups->typed_data(),
                  sums->typed_data<float>());
      return ffi::Error::Success();
    case ffi::DataType::F64:
      GroupSumsOf(group.typed_data(), x.typed_data<double>(), n, width, groups->typed_data(),
                  sums->typed_data<double>());
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("jaxres_group_sums: expected float32 or float64 rows");
  }
}

// A set of slot numbers (non-negative int32), sized for `capacity` of them.
class SlotSet {
 public:
  explicit SlotSet(int64_t capacity) : cells_(int64_t{1} << std::max(1, BitLength(2 * capacity + 1)), -1) {}
  void insert(int32_t slot) {
    if (slot < 0) return;
    int64_t c = find(slot);
    cells_[c] = slot;
  }
  bool contains(int32_t slot) const { return cells_[find(slot)] == slot; }

 private:
  int64_t find(int32_t slot) const {  // the cell holding `slot`, or the empty one it would take
    const int64_t wrap = cells_.size() - 1;
    int64_t c = (static_cast<uint32_t>(slot) * 0x9E3779B1u) & wrap;
    while (cells_[c] >= 0 && cells_[c] != slot) c = (c + 1) & wrap;
    return c;
  }
  std::vector<int32_t> cells_;
};

constexpr int32_t kWindow = 2;  // evicting.WINDOW

// evicting.evict, round for round: each round the lowest pending rows (half
// the batch first, then a chunk) choose the lowest-score eligible entry of
// their current bucket from the records as the round found them; rows whose
// victim is lower than their own score claim it (scratch cells, as
// claims.lowest_writer); the winners then take their victims' slots.
ffi::Error Evict(ffi::Buffer<ffi::U32> records_in, ffi::Buffer<ffi::U32> scores_in, ffi::Buffer<ffi::U32> words_in,
                 ffi::Buffer<ffi::PRED> pending_in, ffi::Buffer<ffi::U32> new_score_in, ffi::Buffer<ffi::S32> named,
                 ffi::ResultBuffer<ffi::U32> records_out, ffi::ResultBuffer<ffi::U32> scores_out,
                 ffi::ResultBuffer<ffi::S32> step_out, ffi::ResultBuffer<ffi::S32> slot_out,
                 ffi::ResultBuffer<ffi::PRED> placed_out, ffi::ResultBuffer<ffi::PRED> refused_out,
                 ffi::ResultBuffer<ffi::S32> victim_slot_out, ffi::ResultBuffer<ffi::U32> victim_words_out,
                 ffi::ResultBuffer<ffi::U32> victim_score_out, int64_t bucket_size, bool protect) {
  uint32_t* records = records_out->typed_data();
  if (records != records_in.typed_data()) std::memcpy(records, records_in.typed_data(), records_in.size_bytes());
  uint32_t* scores = scores_out->typed_data();
  if (scores != scores_in.typed_data()) std::memcpy(scores, scores_in.typed_data(), scores_in.size_bytes());
  return WithBuckets(records, records_in.dimensions(), bucket_size, words_in.dimensions()[1], [&](const auto& t) {
    const int64_t n = words_in.dimensions()[0], W = t.num_words, size = t.bucket_size;
    const uint32_t* words = words_in.typed_data();
    const uint32_t* new_score = new_score_in.typed_data();
    int32_t* step = step_out->typed_data();
    int32_t* slot = slot_out->typed_data();
    bool* placed = placed_out->typed_data();
    bool* refused = refused_out->typed_data();
    int32_t* victim_slot = victim_slot_out->typed_data();
    uint32_t* victim_words = victim_words_out->typed_data();
    uint32_t* victim_score = victim_score_out->typed_data();
    std::fill(step, step + n, 0);
    std::fill(slot, slot + n, 0);
    std::fill(placed, placed + n, false);
    std::fill(refused, refused + n, false);
    std::fill(victim_slot, victim_slot + n, 0);
    std::fill(victim_words, victim_words + n * W, 0u);
    std::fill(victim_score, victim_score + n, 0u);
    const int64_t num_named = protect ? named.element_count() : 0;
    SlotSet taken(num_named + n);  // the slots a row may not evict: named by the call, or placed by it
    for (int64_t k = 0; k < num_named; ++k) taken.insert(named.typed_data()[k]);
    std::vector<char> pending(n);
    std::vector<int64_t> home(n);
    for (int64_t i = 0; i < n; ++i) {
      pending[i] = pending_in.typed_data()[i];
      if (pending[i]) home[i] = t.home(words + i * W);
    }
    std::vector<int64_t> rows, cells, bucket;
    std::vector<int32_t> victim, scratch, writer;
    std::vector<uint32_t> lowest;
    std::vector<char> can;
    for (int32_t rounds = 0; std::any_of(pending.begin(), pending.end(), [](char p) { return p; }); ++rounds) {
      // This round's rows: the lowest pending ones, up to half the batch first, then a chunk.
      const int64_t m = rounds == 0 ? std::max<int64_t>(1, n / 2) : ChunkSize(n);
      rows.clear();
      for (int64_t i = 0; i < n && static_cast<int64_t>(rows.size()) < m; ++i) {
        if (pending[i]) rows.push_back(i);
      }
      const int64_t live = rows.size();
      bucket.resize(live);
      for (int64_t p = 0; p < live; ++p) bucket[p] = (home[rows[p]] + step[rows[p]]) % t.num_buckets;
      victim.assign(m, 0);
      lowest.assign(m, 0);
      can.assign(m, 0);
      for (int64_t p = -kAhead; p < live; ++p) {
        if (p + kAhead < live) {  // the record and scores of a bucket ahead
          t.prefetch(bucket[p + kAhead]);
          __builtin_prefetch(scores + bucket[p + kAhead] * size);
        }
        if (p < 0) continue;
        const int64_t b = bucket[p];
        const uint32_t mask = t.mask(b);
        uint32_t best = UINT32_MAX;
        int64_t choice = 0;  // the first minimum, as argmin
        for (int64_t s = 0; s < size; ++s) {
          const int32_t candidate = static_cast<int32_t>(b * size + s);
          const bool eligible = ((mask >> s) & 1u) && !(protect && taken.contains(candidate));
          if (eligible && scores[candidate] < best) {
            best = scores[candidate];
            choice = s;
          }
        }
        victim[p] = static_cast<int32_t>(b * size + choice);
        lowest[p] = best;
        can[p] = best < new_score[rows[p]];
      }
      const int64_t scratch_size = ScratchSize(m);
      cells.assign(m, 0);
      for (int64_t p = 0; p < m; ++p) cells[p] = CellOf(victim[p], rounds, scratch_size);
      LowestWriter(cells, can, scratch_size, scratch, writer);
      for (int64_t p = 0; p < live; ++p) {
        const int64_t i = rows[p];
        if (!can[p]) {
          if (step[i] < kWindow - 1) {
            ++step[i];  // on to the next bucket
          } else {
            refused[i] = true;
            pending[i] = 0;
          }
          continue;
        }
        if (writer[p] != p) continue;  // lost its cell: chooses again next round
        const int32_t v = victim[p];
        const int64_t b = t.bucket_of(v), s = v - b * size;
        uint32_t* key = t.record(b) + s * W;
        std::memcpy(victim_words + i * W, key, W * sizeof(uint32_t));
        for (int64_t r = 0, h = t.home(key), d = t.distance(h, b); r < d; ++r, h = t.next(h)) t.overflow(h) -= 1u;
        std::memcpy(key, words + i * W, W * sizeof(uint32_t));
        for (int64_t r = 0, h = home[i], d = t.distance(h, b); r < d; ++r, h = t.next(h)) t.overflow(h) += 1u;
        scores[v] = new_score[i];
        if (protect) taken.insert(v);
        slot[i] = victim_slot[i] = v;
        victim_score[i] = lowest[p];
        placed[i] = true;
        pending[i] = 0;
      }
    }
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxresLocate, Locate,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("bucket_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxresLookup, Lookup,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::PRED>>()
                                  .RemainingRets()
                                  .Attr<int64_t>("bucket_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxresSearch, Search,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxresOwner, Owner,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<bool>("last"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxresPrefixSum, PrefixSum,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxresUpsert, Upsert,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("bucket_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxresEvict, Evict,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>()
                                  .Attr<int64_t>("bucket_size")
                                  .Attr<bool>("protect"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxresWriteRows, WriteRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxresTakeRows, TakeRows,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxresGroupSums, GroupSums,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxresReadRows, ReadRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

// ------------------------------------------------------------ Python module

namespace {

PyObject* Targets(PyObject*, PyObject*) {
  PyObject* targets = PyDict_New();
  auto add = [&](const char* name, XLA_FFI_Error* (*fn)(XLA_FFI_CallFrame*)) {
    PyObject* capsule = PyCapsule_New(reinterpret_cast<void*>(fn), nullptr, nullptr);
    PyDict_SetItemString(targets, name, capsule);
    Py_DECREF(capsule);
  };
  add("jaxres_locate", JaxresLocate);
  add("jaxres_lookup", JaxresLookup);
  add("jaxres_search", JaxresSearch);
  add("jaxres_owner", JaxresOwner);
  add("jaxres_upsert", JaxresUpsert);
  add("jaxres_prefix_sum", JaxresPrefixSum);
  add("jaxres_evict", JaxresEvict);
  add("jaxres_read_rows", JaxresReadRows);
  add("jaxres_write_rows", JaxresWriteRows);
  add("jaxres_take_rows", JaxresTakeRows);
  add("jaxres_group_sums", JaxresGroupSums);
  return targets;
}

PyMethodDef kMethods[] = {
    {"targets", Targets, METH_NOARGS, "The FFI handlers of this module, by target name, as capsules."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_kernels", "CPU kernels of jaxres tables (XLA FFI).", -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&kModule); }
