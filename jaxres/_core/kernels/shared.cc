// The kernels every storage uses, registered with XLA's FFI (registration.h):
//
//   jaxres_owner      claims.owner_per_key (kernels/claims.py)
//   jaxres_prefix_sum claims.prefix_sum    (kernels/claims.py)
//   jaxres_read_rows  row_ops.read_rows    (kernels/row_ops.py)
//   jaxres_write_rows row_ops.write_rows   (kernels/row_ops.py)
//   jaxres_take_rows  row_ops.take_rows    (kernels/row_ops.py)
//   jaxres_group_sums grouping.group_sums  (kernels/grouping.py)
//
// Each computes exactly what its pure-XLA counterpart computes (the XLA code is
// the reference and the GPU/TPU path).

#include "kernels.h"

namespace jaxres {
namespace {

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


// The rows `index` (clipped to the leaf) of `leaf` into `to`, each fetched kAhead rows ahead.
void GatherRows(const ffi::AnyBuffer& leaf, const ffi::Buffer<ffi::S32>& index, char* to) {
  const char* from = static_cast<const char*>(leaf.untyped_data());
  const int64_t bytes = RowBytes(leaf), count = leaf.dimensions()[0], n = index.element_count();
  const int32_t* at = index.typed_data();
  auto row = [&](int64_t i) { return from + std::clamp<int64_t>(at[i], 0, count - 1) * bytes; };
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) PrefetchRow(row(i + kAhead), bytes);
    CopyRow(to + i * bytes, row(i), bytes);
  }
}

// row_ops.read_rows: the rows `index` (clipped) of `leaf`, and `leaf` itself as an
// output (aliased: unchanged, in place), which the caller then writes into.
ffi::Error ReadRows(ffi::AnyBuffer leaf, ffi::Buffer<ffi::S32> index, ffi::Result<ffi::AnyBuffer> leaf_out,
                    ffi::Result<ffi::AnyBuffer> rows_out) {
  if (leaf_out->untyped_data() != leaf.untyped_data()) {
    std::memcpy(leaf_out->untyped_data(), leaf.untyped_data(), leaf.size_bytes());
  }
  GatherRows(leaf, index, static_cast<char*>(rows_out->untyped_data()));
  return ffi::Error::Success();
}

// row_ops.write_rows: each leaf with row i of its `rows` written at index[i] where mask[i], in
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
      for (const Column& c : columns) Prefetch<true>(c.to + at[i + kAhead] * c.bytes);
    }
    if (!inside(i)) continue;
    for (const Column& c : columns) CopyRow(c.to + at[i] * c.bytes, c.from + i * c.bytes, c.bytes);
  }
  return ffi::Error::Success();
}

// row_ops.take_rows: the rows `index` (clipped) of `leaf`.
ffi::Error TakeRows(ffi::AnyBuffer leaf, ffi::Buffer<ffi::S32> index, ffi::Result<ffi::AnyBuffer> rows_out) {
  GatherRows(leaf, index, static_cast<char*>(rows_out->untyped_data()));
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

// grouping.group_sums: the distinct groups >= 0 in ascending order (-1 after them), and for each
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

}  // namespace
}  // namespace jaxres

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxresOwner, jaxres::Owner,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::PRED>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Attr<bool>("last"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxresPrefixSum, jaxres::PrefixSum,
                              xla::ffi::Ffi::Bind().Arg<xla::ffi::Buffer<xla::ffi::S32>>().Ret<xla::ffi::Buffer<xla::ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxresWriteRows, jaxres::WriteRows,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::PRED>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxresTakeRows, jaxres::TakeRows,
                              xla::ffi::Ffi::Bind().Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::Buffer<xla::ffi::S32>>().Ret<xla::ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxresGroupSums, jaxres::GroupSums,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxresReadRows, jaxres::ReadRows,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>());

JAXRES_REGISTER_KERNEL("jaxres_owner", JaxresOwner);
JAXRES_REGISTER_KERNEL("jaxres_prefix_sum", JaxresPrefixSum);
JAXRES_REGISTER_KERNEL("jaxres_write_rows", JaxresWriteRows);
JAXRES_REGISTER_KERNEL("jaxres_take_rows", JaxresTakeRows);
JAXRES_REGISTER_KERNEL("jaxres_group_sums", JaxresGroupSums);
JAXRES_REGISTER_KERNEL("jaxres_read_rows", JaxresReadRows);
