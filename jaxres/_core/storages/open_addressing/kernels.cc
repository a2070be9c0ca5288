// CPU kernels of the open-addressing table, registered with XLA's FFI (see
// jaxres/_core/kernels/registration.h):
//
//   jaxres_locate OpenAddressingTable._locate      (storages/open_addressing/table.py)
//   jaxres_lookup OpenAddressingTable._lookup_rows (storages/open_addressing/table.py)
//   jaxres_upsert placing.upsert_slots             (storages/open_addressing/placing.py)
//   jaxres_evict  eviction_rounds.evict            (storages/open_addressing/eviction_rounds.py)
//
// Each computes exactly what its pure-XLA counterpart computes (the XLA code is
// the reference and the GPU/TPU path). The XLA versions work in data-parallel
// rounds; these run the same rounds one row at a time, without the per-op
// overhead of XLA:CPU, with software prefetching of the bucket records. The
// read-only kernels (locate, lookup) split their rows over XLA's intra-op thread
// pool; every row is computed by exactly one thread from inputs no thread
// writes, so results never depend on scheduling. The upsert and evict kernels
// run their rounds on one thread.

#include "kernels.h"

namespace jaxres::open_addressing {
namespace {

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
    return by_buckets.mod(HashWords(words, num_words, kBucketSeed));
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
    Prefetch(first);
    if ((reinterpret_cast<uintptr_t>(first) ^ reinterpret_cast<uintptr_t>(last)) >> 6) Prefetch(last);
  }
};

// Calls body(t) with the view `t` of records [num_buckets, width] of keys of `num_words` words,
// its shape a compile-time constant where it is one of constants.COMMON_BUCKET_SHAPES (the
// defaults: 7 slots for 1-word keys, 4 for 2-word keys; 8 for an evicting table).
template <typename Body>
ffi::Error WithBuckets(uint32_t* records, const ffi::Span<const int64_t> dims, int64_t bucket_size,
                       int64_t num_words, const Body& body) {
#define JAXRES_WITH_SHAPE(W, S) \
  if (num_words == W && bucket_size == S) return body(Buckets<W, S>(records, dims, bucket_size, num_words));
  JAXRES_COMMON_BUCKET_SHAPES(JAXRES_WITH_SHAPE)
#undef JAXRES_WITH_SHAPE
  return body(Buckets<0, 0>(records, dims, bucket_size, num_words));
}

// -------------------------------------------------------- probes

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

// ------------------------------------------------------------------ kernels

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
          Prefetch(columns[c].from + row[k % kLag] * kBytes);
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
  const int64_t n = words.dimensions()[0];
  std::vector<Column> columns;
  if (!LookupColumns(leaves, outputs, n, columns)) {
    return ffi::Error::InvalidArgument("jaxres_lookup: expected a default leaf per value leaf");
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

// grouping.admit: which new rows may insert when `room` more keys fit (the rows of the first
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
        lane[i] = (HashWords(words + i * W, W, kLaneSeed) * kGoldenMix) >> 16;
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
        Prefetch<true>(&scratch[cell[claimants[j + kAhead]]]);
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

// Slots mapped to int32 values (-1: none), for up to `capacity` slots: a batch's, never a table's.
class SlotMap {
 public:
  explicit SlotMap(int64_t capacity)
      : keys_(int64_t{1} << std::max(1, BitLength(2 * capacity + 1)), -1), values_(keys_.size(), -1) {}
  void set(int32_t slot, int32_t value) {
    const int64_t c = find(slot);
    keys_[c] = slot;
    values_[c] = value;
  }
  int32_t get(int32_t slot) const {
    const int64_t c = find(slot);
    return keys_[c] == slot ? values_[c] : -1;
  }

 private:
  int64_t find(int32_t slot) const {  // the cell holding `slot`, or the empty one it would take
    const int64_t wrap = keys_.size() - 1;
    int64_t c = (static_cast<uint32_t>(slot) * kGoldenMix) & wrap;
    while (keys_[c] >= 0 && keys_[c] != slot) c = (c + 1) & wrap;
    return c;
  }
  std::vector<int32_t> keys_, values_;
};


// The position (0..15) of the first lowest of 16 scores, a[0..8) then b[0..8), and that score:
// branch-free (which candidate is the lowest is unpredictable), as a one-bucket window's scan.
__attribute__((always_inline)) inline int FirstLowestOf16(const uint32_t* a, const uint32_t* b, uint32_t& lowest) {
#if defined(__SSE2__)
  // Unsigned order as signed, the sign bit flipped (SSE2 compares signed 32-bit lanes).
  const __m128i flip = _mm_set1_epi32(INT32_MIN);
  const auto load = [&](const uint32_t* x) {
    return _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)), flip);
  };
  const auto min = [](__m128i x, __m128i y) {
    const __m128i y_lower = _mm_cmpgt_epi32(x, y);
    return _mm_or_si128(_mm_and_si128(y_lower, y), _mm_andnot_si128(y_lower, x));
  };
  const __m128i v[4] = {load(a), load(a + 4), load(b), load(b + 4)};
  __m128i m = min(min(v[0], v[1]), min(v[2], v[3]));
  m = min(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
  m = min(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
  int equal = 0;
  for (int k = 0; k < 4; ++k) equal |= _mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(v[k], m))) << (4 * k);
  lowest = static_cast<uint32_t>(_mm_cvtsi128_si32(m)) ^ 0x80000000u;
  return __builtin_ctz(static_cast<uint32_t>(equal));
#else
  uint32_t x[16];
  std::memcpy(x, a, 8 * sizeof(uint32_t));
  std::memcpy(x + 8, b, 8 * sizeof(uint32_t));
  lowest = UINT32_MAX;
  for (int k = 0; k < 16; ++k) lowest = x[k] < lowest ? x[k] : lowest;
  int at = 0;
  while (x[at] != lowest) ++at;
  return at;
#endif
}

// eviction_rounds.evict, round for round: each round the lowest pending rows (half
// the batch first, then a chunk) choose, from the records as the round found
// them, the lowest-score eligible entry of their two windows and the slot they
// will take (the first free one of their first window, else the victim's if it
// is there); rows whose victim is lower than their own score claim it, then the
// winners claim their slots (scratch cells, as claims.lowest_writer); the rows
// that won both evict their victims and take their rows and the slots. A victim
// placed by an earlier round's row displaces that row. Where floors are kept
// (the lowest score of each bucket, kept exact here as in the table), a row
// finds its victim through them: the first bucket of lowest floor, then its
// first lowest slot; without floors, or when that entry is named by the call
// (protect), by a scan of every candidate.
ffi::Error Evict(ffi::Buffer<ffi::U32> records_in, ffi::Buffer<ffi::U32> scores_in, ffi::Buffer<ffi::U32> floors_in,
                 ffi::Buffer<ffi::U32> words_in, ffi::Buffer<ffi::PRED> pending_in, ffi::Buffer<ffi::U32> new_score_in,
                 ffi::Buffer<ffi::S32> named, ffi::ResultBuffer<ffi::U32> records_out,
                 ffi::ResultBuffer<ffi::U32> scores_out, ffi::ResultBuffer<ffi::U32> floors_out,
                 ffi::ResultBuffer<ffi::S32> slot_out, ffi::ResultBuffer<ffi::PRED> placed_out,
                 ffi::ResultBuffer<ffi::PRED> refused_out, ffi::ResultBuffer<ffi::PRED> displaced_out,
                 ffi::ResultBuffer<ffi::S32> victim_batch_out, ffi::ResultBuffer<ffi::S32> victim_slot_out,
                 ffi::ResultBuffer<ffi::S32> victim_row_out, ffi::ResultBuffer<ffi::U32> victim_words_out,
                 ffi::ResultBuffer<ffi::U32> victim_score_out, int64_t bucket_size, int64_t window, int64_t capacity,
                 bool protect) {
  uint32_t* records = records_out->typed_data();
  if (records != records_in.typed_data()) std::memcpy(records, records_in.typed_data(), records_in.size_bytes());
  uint32_t* scores = scores_out->typed_data();
  if (scores != scores_in.typed_data()) std::memcpy(scores, scores_in.typed_data(), scores_in.size_bytes());
  uint32_t* floors = floors_out->typed_data();
  if (floors != floors_in.typed_data()) std::memcpy(floors, floors_in.typed_data(), floors_in.size_bytes());
  return WithBuckets(records, records_in.dimensions(), bucket_size, words_in.dimensions()[1], [&](const auto& t) {
    const int64_t n = words_in.dimensions()[0], W = t.num_words, size = t.bucket_size;
    const uint32_t* words = words_in.typed_data();
    const uint32_t* new_score = new_score_in.typed_data();
    int32_t* slot = slot_out->typed_data();
    bool* placed = placed_out->typed_data();
    bool* refused = refused_out->typed_data();
    bool* displaced = displaced_out->typed_data();
    int32_t* victim_batch = victim_batch_out->typed_data();
    int32_t* victim_slot = victim_slot_out->typed_data();
    int32_t* victim_row = victim_row_out->typed_data();
    uint32_t* victim_words = victim_words_out->typed_data();
    uint32_t* victim_score = victim_score_out->typed_data();
    std::fill(slot, slot + n, 0);
    std::fill(placed, placed + n, false);
    std::fill(refused, refused + n, false);
    std::fill(displaced, displaced + n, false);
    std::fill(victim_batch, victim_batch + n, -1);
    std::fill(victim_slot, victim_slot + n, 0);
    std::fill(victim_row, victim_row + n, 0);
    std::fill(victim_words, victim_words + n * W, 0u);
    std::fill(victim_score, victim_score + n, 0u);
    const int64_t num_named = protect ? named.element_count() : 0;
    SlotMap taken(num_named);  // the slots a row may not evict: named by the call (value 0)
    for (int64_t k = 0; k < num_named; ++k) {
      if (named.typed_data()[k] >= 0) taken.set(named.typed_data()[k], 0);
    }
    SlotMap newcomer(n);  // the row whose key a slot holds, for keys this call placed
    std::vector<char> pending(pending_in.typed_data(), pending_in.typed_data() + n);
    if (window == 0) {  // eviction_rounds.auto_window
      const int64_t count = std::count(pending.begin(), pending.end(), 1);
      window = 1;
      for (int64_t w = 2; w <= kMaxAutoEvictionWindow; w *= 2) {
        if (count >= (w * capacity + kAutoEvictionShare - 1) / kAutoEvictionShare) window = w;
      }
    }
    std::vector<int64_t> home(n), second(n);
    std::vector<uint32_t> lane(n);
    const Divisor past_first(static_cast<uint32_t>(std::max<int64_t>(1, t.num_buckets - window)));
    for (int64_t i = 0; i < n; ++i) {
      if (pending[i]) {
        home[i] = t.home(words + i * W);
        // Past the first window, at an independent hash (eviction_rounds.windows).
        const int64_t past = past_first.mod(HashWords(words + i * W, W, kEvictionSeed));
        const int64_t b = home[i] + window + past;  // below 2 * num_buckets
        second[i] = t.num_buckets > window ? (b >= t.num_buckets ? b - t.num_buckets : b) : home[i];
        lane[i] = (HashWords(words + i * W, W, kLaneSeed) * kGoldenMix) >> 16;
      }
    }
    const uint32_t all_slots = size >= 32 ? UINT32_MAX : (1u << size) - 1u;
    const auto floor_of = [&](int64_t b) {
      const uint32_t* s = scores + b * size;
      uint32_t lowest = s[0];
      for (int64_t k = 1; k < size; ++k) lowest = std::min(lowest, s[k]);
      return lowest;
    };
    // Where x[a..a + len) (a run of buckets' floors, or of their slots' scores) holds a value below
    // `best`: its first lowest becomes `best` and its position `choice`. Branch-free but for the last
    // step: which position of a scan is the lowest is unpredictable.
    const auto lower_in = [](const uint32_t* x, int64_t a, int64_t len, uint32_t& best, int64_t& choice) {
      uint32_t lowest = UINT32_MAX;
      for (int64_t k = a; k < a + len; ++k) lowest = x[k] < lowest ? x[k] : lowest;
      if (lowest < best) {
        best = lowest;
        int64_t k = a;
        while (x[k] != lowest) ++k;
        choice = k;
      }
    };
    // Calls f(a, len) for the runs of consecutive buckets of row i's windows, in the order candidates
    // rank (a window wraps past the last bucket; no division).
    const auto for_each_run = [&](int64_t i, const auto& f) {
      for (const int64_t start : {home[i], second[i]}) {
        for (int64_t a = start, left = window; left > 0; a = 0) {
          const int64_t len = std::min(left, t.num_buckets - a);
          f(a, len);
          left -= len;
        }
      }
    };
    // Floors kept (windows wider than a bucket): a row reads them, then one bucket's scores; else
    // the scores of every candidate. Each pass below reads one kind of line for every row, the
    // lines of the row kRowsAhead on fetched first, so that the misses of many rows overlap.
    const bool with_floors = floors_in.element_count() > 0;
    const uint32_t* per_bucket = with_floors ? floors : scores;
    const int64_t stride = with_floors ? 1 : size;
    const auto fetch_candidates = [&](int64_t i) {  // each run's first line and those it starts
      for_each_run(i, [&](int64_t a, int64_t len) {
        for (int64_t b = a; b < a + len; ++b) {
          if (b == a || (b * stride) % 16 == 0) Prefetch(per_bucket + b * stride);
        }
      });
    };
    std::vector<int64_t> rows, cells, lowest_bucket;
    std::vector<int32_t> victim, target, writer, taker;
    thread_local std::vector<int32_t> scratch;  // free cells, kept from call to call (LowestWriter)
    std::vector<uint32_t> lowest;
    std::vector<char> can, won;
    constexpr int64_t kRowsAhead = 12, kHomesAhead = 24;  // rows whose lines are fetched ahead (measured)
    for (int32_t rounds = 0; std::any_of(pending.begin(), pending.end(), [](char p) { return p; }); ++rounds) {
      // This round's rows: the lowest pending ones, up to half the batch first, then a chunk.
      const int64_t m = rounds == 0 ? std::max<int64_t>(1, n / 2) : ChunkSize(n);
      rows.clear();
      for (int64_t i = 0; i < n && static_cast<int64_t>(rows.size()) < m; ++i) {
        if (pending[i]) rows.push_back(i);
      }
      const int64_t live = rows.size();
      victim.assign(m, 0);
      target.assign(m, -1);
      lowest.assign(m, UINT32_MAX);
      lowest_bucket.assign(m, 0);
      can.assign(m, 0);
      // Pass 1: each row's victim, the first lowest candidate; where floors are kept, first the first
      // bucket of the lowest floor (home where all are free), its scores read in pass 2.
      const auto scan = [&](int64_t p) {
        const int64_t i = rows[p];
        uint32_t best = UINT32_MAX;
        int64_t choice = home[i] * size;
        if (!protect && window == 1 && size == 8) {
          const int at = FirstLowestOf16(scores + home[i] * 8, scores + second[i] * 8, best);
          choice = (at < 8 ? home[i] : second[i]) * 8 + (at & 7);
        } else if (!protect) {
          for_each_run(i, [&](int64_t a, int64_t len) { lower_in(scores, a * size, len * size, best, choice); });
        } else {  // named entries are not candidates
          for_each_run(i, [&](int64_t a, int64_t len) {
            for (int64_t s = a * size; s < (a + len) * size; ++s) {
              if (scores[s] < best && taken.get(static_cast<int32_t>(s)) < 0) {
                best = scores[s];
                choice = s;
              }
            }
          });
        }
        victim[p] = static_cast<int32_t>(best == UINT32_MAX ? home[i] * size : choice);
        lowest[p] = best;
      };
      for (int64_t p = 0; p < std::min<int64_t>(kRowsAhead, live); ++p) fetch_candidates(rows[p]);
      for (int64_t p = 0; p < live; ++p) {
        const int64_t i = rows[p];
        if (p + kRowsAhead < live) fetch_candidates(rows[p + kRowsAhead]);
        if (!with_floors) {
          scan(p);
          continue;
        }
        uint32_t best = UINT32_MAX;
        int64_t at = home[i];
        for_each_run(i, [&](int64_t a, int64_t len) { lower_in(floors, a, len, best, at); });
        lowest_bucket[p] = at;
        Prefetch(scores + at * size);
      }
      // Pass 2, floors kept: the first lowest slot of that bucket; if the call names its entry, a scan.
      for (int64_t p = 0; p < live && with_floors; ++p) {
        uint32_t best = UINT32_MAX;
        int64_t choice = home[rows[p]] * size;
        lower_in(scores, lowest_bucket[p] * size, size, best, choice);
        if (protect && best != UINT32_MAX && taken.get(static_cast<int32_t>(choice)) >= 0) {
          scan(p);
        } else {
          victim[p] = static_cast<int32_t>(choice);
          lowest[p] = best;
        }
      }
      // Pass 3: the slot each row's key takes: the lane's free slot in the first bucket of its first
      // window with room, else the victim's if it is in that window.
      const auto fetch_home = [&](int64_t i) {
        t.prefetch(home[i]);
        Prefetch(scores + home[i] * size);
      };
      for (int64_t p = 0; p < std::min<int64_t>(kHomesAhead, live); ++p) fetch_home(rows[p]);
      for (int64_t p = 0; p < live; ++p) {
        const int64_t i = rows[p];
        if (p + kHomesAhead < live) fetch_home(rows[p + kHomesAhead]);
        int64_t first_free = -1;
        for (int64_t w = 0, b = home[i]; w < window; ++w, b = t.next(b)) {
          const uint32_t free = ~t.mask(b) & all_slots;
          if (free) {
            first_free = b * size + NthSetBit(free, SmallDivisors()[BitCount(free)].mod(lane[i]));
            break;
          }
        }
        const bool in_first = t.distance(home[i], t.bucket_of(victim[p])) < window;
        target[p] = static_cast<int32_t>(first_free >= 0 ? first_free : (in_first ? victim[p] : -1));
        can[p] = lowest[p] < new_score[i] && target[p] >= 0;
      }
      const int64_t scratch_size = ScratchSize(m, kEvictionCellsPerRow);
      cells.assign(m, 0);
      for (int64_t p = 0; p < m; ++p) cells[p] = CellOf(victim[p], rounds, scratch_size);
      LowestWriter(cells, can, scratch_size, scratch, writer);
      won.assign(m, 0);
      for (int64_t p = 0; p < m; ++p) won[p] = can[p] && writer[p] == p;
      for (int64_t p = 0; p < m; ++p) cells[p] = CellOf(target[p], rounds, scratch_size);
      LowestWriter(cells, won, scratch_size, scratch, taker);
      for (int64_t p = 0; p < live; ++p) {
        const int64_t i = rows[p];
        if (p + kRowsAhead < live && can[p + kRowsAhead]) t.prefetch(t.bucket_of(victim[p + kRowsAhead]));
        if (!can[p]) {
          refused[i] = true;
          pending[i] = 0;
          continue;
        }
        if (!won[p] || taker[p] != p) continue;  // lost a claim: chooses again next round
        const int32_t v = victim[p], to = target[p];
        const int64_t vb = t.bucket_of(v), vs = v - vb * size;
        uint32_t* key = t.record(vb) + vs * W;
        std::memcpy(victim_words + i * W, key, W * sizeof(uint32_t));
        const uint32_t row = t.row(vb, vs);
        for (int64_t r = 0, h = t.home(key), d = t.distance(h, vb); r < d; ++r, h = t.next(h)) t.overflow(h) -= 1u;
        t.mask(vb) -= 1u << vs;
        t.store(to, words + i * W);
        const int64_t tb = t.bucket_of(to);
        t.row(tb, to - tb * size) = row;
        for (int64_t r = 0, h = home[i], d = t.distance(h, tb); r < d; ++r, h = t.next(h)) t.overflow(h) += 1u;
        scores[v] = UINT32_MAX;  // free
        scores[to] = new_score[i];
        if (with_floors) {
          floors[vb] = floor_of(vb);
          floors[tb] = floor_of(tb);
        }
        const int32_t before = newcomer.get(v);
        if (before >= 0) {  // a key this call placed: displaced
          placed[before] = false;
          displaced[before] = true;
          victim_batch[i] = before;
          newcomer.set(v, -1);
        }
        newcomer.set(to, static_cast<int32_t>(i));
        slot[i] = to;
        victim_slot[i] = v;
        victim_row[i] = static_cast<int32_t>(row);
        victim_score[i] = lowest[p];
        placed[i] = true;
        pending[i] = 0;
      }
    }
    return ffi::Error::Success();
  });
}

}  // namespace
}  // namespace jaxres::open_addressing

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxresLocate, jaxres::open_addressing::Locate,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::PRED>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Attr<int64_t>("bucket_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxresLookup, jaxres::open_addressing::Lookup,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .RemainingArgs()
                                  .Ret<xla::ffi::Buffer<xla::ffi::PRED>>()
                                  .RemainingRets()
                                  .Attr<int64_t>("bucket_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxresUpsert, jaxres::open_addressing::Upsert,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::PRED>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::PRED>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::PRED>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Attr<int64_t>("bucket_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxresEvict, jaxres::open_addressing::Evict,
                              xla::ffi::Ffi::Bind()
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
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::PRED>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::PRED>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::PRED>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Attr<int64_t>("bucket_size")
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("capacity")
                                  .Attr<bool>("protect"));

JAXRES_REGISTER_KERNEL("jaxres_locate", JaxresLocate);
JAXRES_REGISTER_KERNEL("jaxres_lookup", JaxresLookup);
JAXRES_REGISTER_KERNEL("jaxres_upsert", JaxresUpsert);
JAXRES_REGISTER_KERNEL("jaxres_evict", JaxresEvict);
