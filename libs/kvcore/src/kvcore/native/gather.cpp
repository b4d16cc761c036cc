// kvcore._native_gather: dtype-agnostic gather/scatter of token rows (rows of bytes), C++/OpenMP.
//
//   gather_rows(...)  dst[dst_index[r], slot] = pool[block_table[r, tok // bs], tok % bs]
//   scatter_rows(...) pool[slot // bs, slot % bs] = src[i]   (pool rows row_stride bytes apart)
// Arguments are data_ptr() integers and sizes of contiguous CPU uint8/int tensors validated by the
// Python wrapper (kvcore/gather.py). Every index is checked here first, over all rows, together
// with "no destination written twice"; the first bad position (lowest i) raises ValueError naming
// the argument, the position and the value, and nothing is copied. The copy then runs in parallel
// over chunks of rows (OpenMP), one memcpy per row, with software prefetch of upcoming rows. The GIL is released throughout.

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <omp.h>
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

// Work items are spread over the process's OpenMP threads (torch's libgomp when torch is loaded
// first: the threads its own ops just used), statically so each thread gets a contiguous range.
template <typename F>
void parallel_for(int64_t n, F&& body) {
#pragma omp parallel for schedule(static) if (n > 1)
  for (int64_t i = 0; i < n; ++i) body(i);
}

constexpr int64_t kPrefetchRows = 8;        // rows prefetched ahead of the copy
constexpr int64_t kChunkBytes = 128 << 10;  // bytes copied per work item

struct Error {
  int kind = 0;
  int64_t i = 0, a = 0, b = 0, c = 0;  // position and values (meaning depends on kind)
};

inline void prefetch_row(const uint8_t* p, int64_t n, bool write) {
  for (int64_t o = 0; o < n; o += 64) {
    if (write)
      __builtin_prefetch(p + o, 1, 3);
    else
      __builtin_prefetch(p + o, 0, 3);
  }
}

// Copies n rows: dst + dst_row[i] * dst_stride <- src + src_row[i] * row_bytes, in chunks of about
// kChunkBytes spread over the pool. src_row/dst_row may be null for "row i" (contiguous side);
// dst_stride: bytes from one destination row to the next (>= row_bytes).
void copy_rows(const uint8_t* src, const int64_t* src_row, uint8_t* dst, const int64_t* dst_row,
               int64_t n, int64_t row_bytes, int64_t dst_stride) {
  const int64_t per_chunk = std::max<int64_t>(1, kChunkBytes / row_bytes);
  const int64_t chunks = (n + per_chunk - 1) / per_chunk;
  auto sp = [&](int64_t i) { return src + (src_row ? src_row[i] : i) * row_bytes; };
  auto dp = [&](int64_t i) { return dst + (dst_row ? dst_row[i] : i) * dst_stride; };
  parallel_for(chunks, [&](int64_t c) {
    const int64_t lo = c * per_chunk, hi = std::min(n, lo + per_chunk);
    for (int64_t i = lo; i < std::min(hi, lo + kPrefetchRows); ++i) {
      if (src_row) prefetch_row(sp(i), row_bytes, false);
      if (dst_row) prefetch_row(dp(i), row_bytes, true);
    }
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t ahead = i + kPrefetchRows;
      if (ahead < hi) {
        if (src_row) prefetch_row(sp(ahead), row_bytes, false);
        if (dst_row) prefetch_row(dp(ahead), row_bytes, true);
      }
      std::memcpy(dp(i), sp(i), static_cast<size_t>(row_bytes));
    }
  });
}

// Index of the first position that repeats an earlier key (keys in [0, universe)), or -1.
int64_t first_repeat(const int64_t* keys, int64_t n, int64_t universe) {
  if (universe / 64 <= 16 * n) {  // bitmap cheaper than sorting
    std::vector<uint64_t> seen(static_cast<size_t>(universe / 64 + 1), 0);
    for (int64_t i = 0; i < n; ++i) {
      uint64_t bit = uint64_t{1} << (keys[i] & 63);
      uint64_t& w = seen[keys[i] >> 6];
      if (w & bit) return i;
      w |= bit;
    }
    return -1;
  }
  std::vector<std::pair<int64_t, int64_t>> kv(n);
  for (int64_t i = 0; i < n; ++i) kv[i] = {keys[i], i};
  std::sort(kv.begin(), kv.end());
  int64_t best = -1;
  for (int64_t j = 1; j < n; ++j)
    if (kv[j].first == kv[j - 1].first && (best < 0 || kv[j].second < best)) best = kv[j].second;
  return best;
}

// Runs check(i) for all i (chunks spread over the pool); returns the error with the lowest i.
template <typename F>
Error first_error(int64_t n, F check) {
  constexpr int64_t kChunk = 2048;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<Error> errors(chunks);
  parallel_for(chunks, [&](int64_t c) {
    for (int64_t i = c * kChunk, hi = std::min(n, i + kChunk); i < hi; ++i) {
      Error e = check(i);
      if (e.kind != 0) {
        errors[c] = e;
        return;
      }
    }
  });
  for (const Error& e : errors)
    if (e.kind != 0) return e;
  return Error{};
}

std::string gather_message(const Error& e, int64_t R, int64_t max_blocks, int64_t num_blocks,
                           int64_t capacity, int64_t D) {
  std::ostringstream os;
  os << "gather_rows: ";
  switch (e.kind) {
    case 1: os << "miss_rows[" << e.i << "] = " << e.a << " is out of range [0, " << R << ")"; break;
    case 2: os << "miss_tokens[" << e.i << "] = " << e.a << " is negative"; break;
    case 3:
      os << "miss_tokens[" << e.i << "] = " << e.a << " lies in logical block " << e.b
         << ", beyond block_table's max_blocks = " << max_blocks;
      break;
    case 4:
      os << "block_table[" << e.b << ", " << e.c << "] = -1 (unallocated) for miss_tokens[" << e.i
         << "] = " << e.a;
      break;
    case 5:
      os << "block_table[" << e.b << ", " << e.c << "] = " << e.a << " is out of range [0, "
         << num_blocks << ") for miss_tokens[" << e.i << "]";
      break;
    case 6:
      os << "miss_slots[" << e.i << "] = " << e.a << " is out of range [0, " << capacity << ")";
      break;
    case 7:
      os << "dst_index[" << e.b << "] = " << e.a << " is out of range [0, " << D
         << ") for miss_rows[" << e.i << "]";
      break;
    case 8:
      os << "miss_slots[" << e.i << "] = " << e.a << " writes dst[" << e.b << ", " << e.a
         << "] a second time";
      break;
    default: os << "unknown error";
  }
  return os.str();
}

void gather_rows(uintptr_t pool_ptr, int64_t num_blocks, int64_t block_size, int64_t row_bytes,
                 uintptr_t block_table_ptr, int64_t R, int64_t max_blocks, uintptr_t miss_rows_ptr,
                 uintptr_t miss_tokens_ptr, int64_t M, uintptr_t dst_ptr, int64_t D,
                 int64_t capacity, uintptr_t dst_index_ptr, uintptr_t miss_slots_ptr) {
  if (block_size <= 0) throw py::value_error("gather_rows: block_size must be >= 1");
  if (M <= 0 || row_bytes <= 0) return;
  const auto* pool = reinterpret_cast<const uint8_t*>(pool_ptr);
  const auto* table = reinterpret_cast<const int32_t*>(block_table_ptr);
  const auto* rows = reinterpret_cast<const int32_t*>(miss_rows_ptr);
  const auto* tokens = reinterpret_cast<const int64_t*>(miss_tokens_ptr);
  auto* dst = reinterpret_cast<uint8_t*>(dst_ptr);
  const auto* dst_index = reinterpret_cast<const int32_t*>(dst_index_ptr);
  const auto* slots = reinterpret_cast<const int32_t*>(miss_slots_ptr);
  Error err;
  {
    py::gil_scoped_release release;
    std::unique_ptr<int64_t[]> src_row(new int64_t[M]), dst_row(new int64_t[M]);
    err = first_error(M, [&](int64_t i) -> Error {
      Error e;
      e.i = i;
      const int64_t r = rows[i];
      if (r < 0 || r >= R) { e.kind = 1; e.a = r; return e; }
      const int64_t t = tokens[i];
      if (t < 0) { e.kind = 2; e.a = t; return e; }
      const int64_t lb = t / block_size;
      if (lb >= max_blocks) { e.kind = 3; e.a = t; e.b = lb; return e; }
      const int64_t b = table[r * max_blocks + lb];
      if (b == -1) { e.kind = 4; e.a = t; e.b = r; e.c = lb; return e; }
      if (b < 0 || b >= num_blocks) { e.kind = 5; e.a = b; e.b = r; e.c = lb; return e; }
      const int64_t s = slots[i];
      if (s < 0 || s >= capacity) { e.kind = 6; e.a = s; return e; }
      const int64_t d = dst_index[r];
      if (d < 0 || d >= D) { e.kind = 7; e.a = d; e.b = r; return e; }
      src_row[i] = b * block_size + t % block_size;
      dst_row[i] = d * capacity + s;
      return Error{};
    });
    if (err.kind == 0) {
      const int64_t rep = first_repeat(dst_row.get(), M, D * capacity);
      if (rep >= 0) {
        err.kind = 8; err.i = rep; err.a = slots[rep]; err.b = dst_index[rows[rep]];
      }
    }
    if (err.kind == 0) copy_rows(pool, src_row.get(), dst, dst_row.get(), M, row_bytes, row_bytes);
  }
  if (err.kind != 0) throw py::value_error(gather_message(err, R, max_blocks, num_blocks, capacity, D));
}

void scatter_rows(uintptr_t pool_ptr, int64_t num_blocks, int64_t block_size, int64_t row_bytes,
                  uintptr_t slot_mapping_ptr, int64_t M, uintptr_t src_ptr, int64_t row_stride) {
  if (row_stride < row_bytes)
    throw py::value_error("scatter_rows: row_stride = " + std::to_string(row_stride) + " is below row_bytes = " +
                          std::to_string(row_bytes) + " (rows would overlap)");
  if (M <= 0 || row_bytes <= 0) return;
  auto* pool = reinterpret_cast<uint8_t*>(pool_ptr);
  const auto* mapping = reinterpret_cast<const int64_t*>(slot_mapping_ptr);
  const auto* src = reinterpret_cast<const uint8_t*>(src_ptr);
  const int64_t total = num_blocks * block_size;
  Error err;
  {
    py::gil_scoped_release release;
    err = first_error(M, [&](int64_t i) -> Error {
      Error e;
      e.i = i;
      if (mapping[i] < 0 || mapping[i] >= total) { e.kind = 1; e.a = mapping[i]; }
      return e;
    });
    if (err.kind == 0) {
      const int64_t rep = first_repeat(mapping, M, total);
      if (rep >= 0) { err.kind = 2; err.i = rep; err.a = mapping[rep]; }
    }
    if (err.kind == 0) copy_rows(src, nullptr, pool, mapping, M, row_bytes, row_stride);
  }
  if (err.kind == 1)
    throw py::value_error("scatter_rows: slot_mapping[" + std::to_string(err.i) + "] = " +
                          std::to_string(err.a) + " is out of range [0, " + std::to_string(total) +
                          ") (num_blocks * block_size)");
  if (err.kind == 2)
    throw py::value_error("scatter_rows: slot_mapping[" + std::to_string(err.i) + "] = " +
                          std::to_string(err.a) + " writes that pool row a second time");
}

}  // namespace

PYBIND11_MODULE(_native_gather, m) {
  m.doc() = "Native gather/scatter of token rows (bytes) with bounds checks; see kvcore.gather.";
  m.def("max_threads", []() { return omp_get_max_threads(); });
  // OpenMP's thread count is per calling thread: a background loader sets 1 so its gathers never
  // start a second team that spins against the main thread's.
  m.def("set_calling_thread_threads", [](int n) { omp_set_num_threads(n); }, py::arg("n"));
  m.def("gather_rows", &gather_rows, py::arg("pool_ptr"), py::arg("num_blocks"),
        py::arg("block_size"), py::arg("row_bytes"), py::arg("block_table_ptr"), py::arg("R"),
        py::arg("max_blocks"), py::arg("miss_rows_ptr"), py::arg("miss_tokens_ptr"), py::arg("M"),
        py::arg("dst_ptr"), py::arg("D"), py::arg("capacity"), py::arg("dst_index_ptr"),
        py::arg("miss_slots_ptr"));
  m.def("scatter_rows", &scatter_rows, py::arg("pool_ptr"), py::arg("num_blocks"),
        py::arg("block_size"), py::arg("row_bytes"), py::arg("slot_mapping_ptr"), py::arg("M"),
        py::arg("src_ptr"), py::arg("row_stride"));
}
