// kvcore._native_hotcache: per-(request, layer) hot top-k residency (exact LRU or segmented LRU),
// C++/OpenMP.
//
// The semantics are defined in kvcore/hotcache.py's module docstring and mirrored line by line by
// its Python reference; tests require identical outputs. This file owns only the fast path:
//   Cache(capacity, num_layers, policy)   native state of one HotCache (policy 0 = "lru",
//                                 1 = "slru"); requests are integer handles.
//   alloc() -> handle, free(handle), residency(handle, layer) -> [(token, slot)]
//   resolve(layer, handles, topk_ptr, k, topk_is_int64, stable_lens, slots_ptr, miss_rows_ptr,
//           miss_tokens_ptr, miss_slots_ptr) -> (num_hits, num_misses)
// Pointers are data_ptr() integers of CPU tensors validated by the Python wrapper (dtype,
// contiguity, shapes); every index is re-checked here before any state changes, and an error is
// raised as ValueError naming the argument, the position and the value. The GIL is released while
// rows are processed (OpenMP over rows: each row is a different request).
//
// Threading contract: calls may run concurrently from several Python threads provided they touch
// disjoint (request, layer) pairs (e.g. different layers). alloc/free take the table lock
// exclusively; resolve holds it shared.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {


// Largest accepted token index: the token->slot map is a dense int32 array indexed by token.
constexpr int64_t kMaxToken = 2147483646;  // INT32_MAX - 1

// State of one (request, layer): `capacity` slots as nodes of two circular doubly-linked LRU lists,
// the probation list with its sentinel node at index `capacity` and the protected list with its
// sentinel at `capacity + 1` (next of a sentinel = least recent, prev = most recent). Misses and
// empty slots live in probation; hits move to protected under "slru" and to probation under
// "lru" (so "lru" is one list). Unlinking needs no list id: prev/next stay within a list.
// A node packs everything a hit or a miss touches into 16 bytes (4 per cache line).
struct Node {
  int32_t prev, next;
  int32_t token;   // -1 = empty
  uint32_t epoch;  // == LayerState::epoch: selected in the current step
};

struct LayerState {
  explicit LayerState(int32_t capacity) : cap(capacity), nodes(capacity + 2) {
    // New state: probation from least recent 0, 1, ..., capacity-1; protected empty.
    for (int32_t i = 0; i <= cap; ++i)
      nodes[i] = Node{(i + cap) % (cap + 1), (i + 1) % (cap + 1), -1, 0};
    nodes[cap + 1] = Node{cap + 1, cap + 1, -1, 0};
  }

  void unlink(Node* n, int32_t s) {
    n[n[s].prev].next = n[s].next;
    n[n[s].next].prev = n[s].prev;
  }
  void to_most_recent(int32_t s) {
    Node* n = nodes.data();
    unlink(n, s);
    const int32_t last = n[cap].prev;
    n[last].next = s;
    n[s].prev = last;
    n[s].next = cap;
    n[cap].prev = s;
  }
  void to_least_recent(int32_t s) {
    Node* n = nodes.data();
    unlink(n, s);
    const int32_t first = n[cap].next;
    n[first].prev = s;
    n[s].next = first;
    n[s].prev = cap;
    n[cap].next = s;
  }
  void empty_slot(int32_t s) {
    token_slot[nodes[s].token] = -1;
    nodes[s].token = -1;
    to_least_recent(s);
  }
  void ensure_token(int64_t max_token) {
    if (max_token < static_cast<int64_t>(token_slot.size())) return;
    int64_t n = std::max<int64_t>(max_token + 1, 2 * static_cast<int64_t>(token_slot.size()));
    n = std::min<int64_t>(n, kMaxToken + 1);
    token_slot.resize(static_cast<size_t>(n), -1);
  }
  uint32_t next_epoch() {
    if (++epoch == 0) {  // wrapped: forget all marks
      for (auto& nd : nodes) nd.epoch = 0;
      epoch = 1;
    }
    return epoch;
  }

  int32_t cap;
  std::vector<Node> nodes;          // [cap + 2], sentinels: cap (probation), cap + 1 (protected)
  uint32_t epoch = 0;
  std::vector<int32_t> token_slot;  // dense token -> slot, -1 = absent
  int64_t resident_bound = 0;       // every resident token < resident_bound
};

struct RequestState {
  std::vector<std::unique_ptr<LayerState>> layers;  // [num_layers], created on first use
};

// First invalid input found by validation (row-major position), reported after the GIL is back.
struct Error {
  int kind = 0;  // 0 none, 1 stable_lens negative, 2 topk negative, 3 topk too large
  int64_t row = 0, col = 0, value = 0;
};

template <typename T>
Error check_row(const T* topk, int64_t k, int64_t r, int64_t stable, int64_t* max_token) {
  Error e;
  if (stable < 0) {
    e.kind = 1; e.row = r; e.value = stable;
    return e;
  }
  int64_t lo = -1, hi = -1;  // branch-free min/max (vectorizes); locate the culprit only on error
  for (int64_t j = 0; j < k; ++j) {
    const int64_t t = static_cast<int64_t>(topk[j]);
    lo = std::min(lo, t);
    hi = std::max(hi, t);
  }
  if (lo < -1 || hi > kMaxToken) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t t = static_cast<int64_t>(topk[j]);
      if (t < -1 || t > kMaxToken) {
        e.kind = t < -1 ? 2 : 3; e.row = r; e.col = j; e.value = t;
        return e;
      }
    }
  }
  *max_token = hi;
  return e;
}

constexpr int64_t kPrefetch = 16;  // top-k positions looked up ahead
constexpr int64_t kWalkAhead = 8;  // LRU victims prefetched ahead
constexpr int64_t kParallelEntries = 4096;  // fewer top-k entries per call: one thread

// LRU moves on raw node pointers (locals keep the compiler from reloading vector internals):
// `s` moves to the most-recent end of the list whose sentinel is `list`.
inline void move_to_most_recent(Node* __restrict n, int32_t list, int32_t s) {
  const int32_t p = n[s].prev, q = n[s].next;
  n[p].next = q;
  n[q].prev = p;
  const int32_t last = n[list].prev;
  n[last].next = s;
  n[s].prev = last;
  n[s].next = list;
  n[list].prev = s;
}

// One step of one row; semantics in kvcore/hotcache.py. Returns (hits, misses); misses are
// written in order of first top-k occurrence to the miss_* arrays (row-local region).
// `hit_pos`/`miss_pos` are scratch arrays of k entries.
template <typename T>
std::pair<int64_t, int64_t> resolve_row(LayerState& st, const T* __restrict topk, int64_t k,
                                        int64_t stable, int32_t row, int32_t* __restrict slots,
                                        int32_t* __restrict miss_rows,
                                        int64_t* __restrict miss_tokens,
                                        int32_t* __restrict miss_slots, int32_t* __restrict hit_pos,
                                        int32_t* __restrict miss_pos, std::vector<int32_t>& spec,
                                        bool slru) {
  const int32_t cap = st.cap;
  const int32_t hit_list = slru ? cap + 1 : cap;
  // (1) Drop tokens >= stable (only possible when the stable length shrank).
  if (stable < st.resident_bound) {
    for (int32_t s = 0; s < cap; ++s)
      if (st.nodes[s].token >= stable) st.empty_slot(s);
  }
  const uint32_t ep = st.next_epoch();
  Node* __restrict nd = st.nodes.data();
  int32_t* __restrict ts = st.token_slot.data();
  // Lookup, branch-free: resident positions go to hit_pos, absent non-padding ones to miss_pos.
  int64_t nh = 0, nm = 0;
  for (int64_t j = 0; j < k; ++j) {
    if (j + kPrefetch < k) {
      const int64_t t2 = static_cast<int64_t>(topk[j + kPrefetch]);
      __builtin_prefetch(ts + (t2 < 0 ? 0 : t2));
    }
    const int64_t t = static_cast<int64_t>(topk[j]);
    const int32_t s = ts[t < 0 ? 0 : t] | static_cast<int32_t>(t >> 63);  // padding -> -1
    slots[j] = s;
    hit_pos[nh] = static_cast<int32_t>(j);
    miss_pos[nm] = static_cast<int32_t>(j);
    nh += s >= 0;
    nm += (s < 0) & (t >= 0);
  }
  // (2) Hits move to the most-recent end once, on their first occurrence.
  int64_t hits = 0;
  for (int64_t i = 0; i < nh; ++i) {
    if (i + kPrefetch / 2 < nh) __builtin_prefetch(nd + slots[hit_pos[i + kPrefetch / 2]], 1);
    if (i + kPrefetch / 4 < nh) {  // the list neighbours that unlinking will write
      const Node& a = nd[slots[hit_pos[i + kPrefetch / 4]]];
      __builtin_prefetch(nd + a.prev, 1);
      __builtin_prefetch(nd + a.next, 1);
    }
    const int32_t s = slots[hit_pos[i]];
    if (nd[s].epoch != ep) {
      nd[s].epoch = ep;
      move_to_most_recent(nd, hit_list, s);
      ++hits;
    }
  }
  // (3) Misses take the least-recent slot; duplicates reuse the slot taken in this step. The
  // victims are the list's first nodes in order; a walker prefetches them and their tokens' map
  // entries ahead.
  int64_t misses = 0;
  spec.clear();
  int32_t ahead = nd[cap].next;
  for (int64_t w = 0; w < kWalkAhead && ahead != cap; ++w) ahead = nd[ahead].next;
  for (int64_t i = 0; i < nm; ++i) {
    const int64_t j = miss_pos[i];
    const int64_t t = static_cast<int64_t>(topk[j]);
    int32_t s = ts[t];
    if (s < 0) {
      if (ahead != cap) {
        const int32_t old_ahead = nd[ahead].token;
        __builtin_prefetch(ts + (old_ahead < 0 ? 0 : old_ahead), 1);
        ahead = nd[ahead].next;
        __builtin_prefetch(nd + ahead, 1);
      }
      // The least-recent probation slot; under "slru", when it is the sentinel or selected in this
      // step (then every probation slot is: selected ones sit at its most-recent end), the
      // least-recent protected slot, which then is not selected (unique tokens <= cap).
      s = nd[cap].next;
      if (slru && (s == cap || nd[s].epoch == ep)) s = nd[cap + 1].next;
      const int32_t old = nd[s].token;
      if (old >= 0) ts[old] = -1;
      nd[s].token = static_cast<int32_t>(t);
      nd[s].epoch = ep;
      ts[t] = s;
      move_to_most_recent(nd, cap, s);  // misses enter probation
      miss_rows[misses] = row;
      miss_tokens[misses] = t;
      miss_slots[misses] = s;
      ++misses;
      if (t >= stable) spec.push_back(s);
    }
    slots[j] = s;
  }
  // (4) Speculative tokens loaded in this step do not stay resident.
  if (!spec.empty()) {
    std::sort(spec.begin(), spec.end());
    for (int32_t s : spec) st.empty_slot(s);
  }
  st.resident_bound = stable;
  return {hits, misses};
}

class Cache {
 public:
  Cache(int64_t capacity, int64_t num_layers, int64_t policy)
      : cap_(capacity), num_layers_(num_layers), slru_(policy == 1) {
    if (policy != 0 && policy != 1)
      throw py::value_error("policy = " + std::to_string(policy) + " must be 0 (lru) or 1 (slru)");
    if (capacity <= 0 || capacity > (1 << 30))
      throw py::value_error("capacity = " + std::to_string(capacity) + " must be in [1, 2**30]");
    if (num_layers <= 0)
      throw py::value_error("num_layers = " + std::to_string(num_layers) + " must be >= 1");
  }

  int64_t alloc() {
    std::unique_lock<std::shared_mutex> lock(mu_);
    auto req = std::make_unique<RequestState>();
    req->layers.resize(static_cast<size_t>(num_layers_));
    if (!free_.empty()) {
      int64_t h = free_.back();
      free_.pop_back();
      table_[h] = std::move(req);
      return h;
    }
    table_.push_back(std::move(req));
    return static_cast<int64_t>(table_.size()) - 1;
  }

  void free(int64_t h) {
    std::unique_lock<std::shared_mutex> lock(mu_);
    check_handle(h, -1);
    table_[h].reset();
    free_.push_back(h);
  }

  std::vector<std::pair<int64_t, int32_t>> residency(int64_t h, int64_t layer) {
    std::shared_lock<std::shared_mutex> lock(mu_);
    check_handle(h, -1);
    check_layer(layer);
    std::vector<std::pair<int64_t, int32_t>> out;
    const auto& st = table_[h]->layers[layer];
    if (!st) return out;
    for (int32_t s = 0; s < st->cap; ++s)
      if (st->nodes[s].token >= 0) out.emplace_back(st->nodes[s].token, s);
    return out;
  }

  py::tuple resolve(int64_t layer, const std::vector<int64_t>& handles, uintptr_t topk_ptr,
                    int64_t k, bool topk_is_int64, const std::vector<int64_t>& stable, uintptr_t slots_ptr,
                    uintptr_t miss_rows_ptr, uintptr_t miss_tokens_ptr, uintptr_t miss_slots_ptr) {
    const int64_t rows = static_cast<int64_t>(handles.size());
    check_layer(layer);
    if (static_cast<int64_t>(stable.size()) != rows)
      throw py::value_error("stable_lens has " + std::to_string(stable.size()) +
                            " entries but there are " + std::to_string(rows) + " rows");
    if (k < 0 || k > cap_)
      throw py::value_error("topk has " + std::to_string(k) + " columns but capacity is " +
                            std::to_string(cap_) + " (capacity >= topk guarantees enough slots)");
    int64_t hits = 0, misses = 0;
    Error err;
    {
      py::gil_scoped_release release;
      std::shared_lock<std::shared_mutex> lock(mu_);
      {
        std::vector<int64_t> sorted(handles);
        std::sort(sorted.begin(), sorted.end());
        for (int64_t r = 0; r < rows; ++r) {
          int64_t h = handles[r];
          if (h < 0 || h >= static_cast<int64_t>(table_.size()) || !table_[h]) {
            err.kind = 10; err.row = r; err.value = h; break;
          }
          if (r > 0 && sorted[r] == sorted[r - 1]) { err.kind = 11; err.value = sorted[r]; break; }
        }
      }
      if (err.kind == 0 && rows > 0) {
        if (topk_is_int64)
          err = run<int64_t>(layer, handles, reinterpret_cast<const int64_t*>(topk_ptr), k,
                             stable.data(), slots_ptr, miss_rows_ptr, miss_tokens_ptr,
                             miss_slots_ptr, &hits, &misses);
        else
          err = run<int32_t>(layer, handles, reinterpret_cast<const int32_t*>(topk_ptr), k,
                             stable.data(), slots_ptr, miss_rows_ptr, miss_tokens_ptr,
                             miss_slots_ptr, &hits, &misses);
      }
    }
    if (err.kind != 0) throw py::value_error(message(err));
    return py::make_tuple(hits, misses);
  }

 private:
  template <typename T>
  Error run(int64_t layer, const std::vector<int64_t>& handles, const T* topk, int64_t k,
            const int64_t* stable, uintptr_t slots_ptr, uintptr_t miss_rows_ptr,
            uintptr_t miss_tokens_ptr, uintptr_t miss_slots_ptr, int64_t* hits_out,
            int64_t* misses_out) {
    const int64_t rows = static_cast<int64_t>(handles.size());
    int32_t* slots = reinterpret_cast<int32_t*>(slots_ptr);
    int32_t* miss_rows = reinterpret_cast<int32_t*>(miss_rows_ptr);
    int64_t* miss_tokens = reinterpret_cast<int64_t*>(miss_tokens_ptr);
    int32_t* miss_slots = reinterpret_cast<int32_t*>(miss_slots_ptr);
    std::vector<Error> errors(rows);
    std::vector<int64_t> per_row(static_cast<size_t>(3 * rows), 0);
    int64_t* max_token = per_row.data();  // [rows]
    int64_t* row_hits = max_token + rows;  // [rows]
    int64_t* row_misses = row_hits + rows;  // [rows]
    // Validate every row before touching any state (serial: cheaper than a fork/join).
    for (int64_t r = 0; r < rows; ++r)
      errors[r] = check_row<T>(topk + r * k, k, r, stable[r], &max_token[r]);
    for (int64_t r = 0; r < rows; ++r)
      if (errors[r].kind != 0) return errors[r];
    // Allocate here (may throw) so that the parallel part cannot fail.
    std::vector<LayerState*> states(rows);
    for (int64_t r = 0; r < rows; ++r) {
      auto& slot = table_[handles[r]]->layers[layer];
      if (!slot) slot = std::make_unique<LayerState>(static_cast<int32_t>(cap_));
      slot->ensure_token(std::max<int64_t>(max_token[r], 0));
      states[r] = slot.get();
    }
    std::unique_ptr<int32_t[]> scratch(new int32_t[2 * rows * k + 2]);  // hit/miss positions
    // Static schedule: with the same batch a row (request) stays on its thread, its state in that
    // core's cache. Threads come from the process's OpenMP runtime (torch's libgomp when torch is
    // loaded first), so they are the threads torch's own ops just used. Measured trade-off: a
    // private work-claiming pool was robust when other processes held a core (libgomp's barrier
    // spins ~20 ms before yielding, so a 0.1 ms call can take 12-30 ms then), but it fought
    // torch's spinning OpenMP workers whenever torch ops ran between calls, as in the engine.
#pragma omp parallel for schedule(static) if (rows > 1 && rows * k >= kParallelEntries)
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<int32_t> spec;
      auto hm = resolve_row<T>(*states[r], topk + r * k, k, stable[r], static_cast<int32_t>(r),
                               slots + r * k, miss_rows + r * k, miss_tokens + r * k,
                               miss_slots + r * k, scratch.get() + 2 * r * k,
                               scratch.get() + 2 * r * k + k, spec, slru_);
      row_hits[r] = hm.first;
      row_misses[r] = hm.second;
    }
    // Compact the row-local miss regions (destination offset <= source offset: memmove order).
    int64_t off = 0, hits = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n = row_misses[r];
      if (off != r * k && n > 0) {
        std::move(miss_rows + r * k, miss_rows + r * k + n, miss_rows + off);
        std::move(miss_tokens + r * k, miss_tokens + r * k + n, miss_tokens + off);
        std::move(miss_slots + r * k, miss_slots + r * k + n, miss_slots + off);
      }
      off += n;
      hits += row_hits[r];
    }
    *hits_out = hits;
    *misses_out = off;
    return Error{};
  }

  std::string message(const Error& e) const {
    std::ostringstream os;
    switch (e.kind) {
      case 1: os << "stable_lens[" << e.row << "] = " << e.value << " must be >= 0"; break;
      case 2:
        os << "topk[" << e.row << ", " << e.col << "] = " << e.value
           << " is not a token index (>= 0) or -1 padding";
        break;
      case 3:
        os << "topk[" << e.row << ", " << e.col << "] = " << e.value
           << " exceeds the largest supported token index " << kMaxToken;
        break;
      case 10: os << "request handle " << e.value << " at row " << e.row << " is not allocated"; break;
      case 11: os << "request handle " << e.value << " appears twice in one call"; break;
      default: os << "unknown error";
    }
    return os.str();
  }

  void check_handle(int64_t h, int64_t row) const {
    if (h < 0 || h >= static_cast<int64_t>(table_.size()) || !table_[h])
      throw py::value_error("request handle " + std::to_string(h) + " at row " +
                            std::to_string(row) + " is not allocated");
  }
  void check_layer(int64_t layer) const {
    if (layer < 0 || layer >= num_layers_)
      throw py::value_error("layer = " + std::to_string(layer) + " is out of range [0, " +
                            std::to_string(num_layers_) + ")");
  }

  int64_t cap_, num_layers_;
  bool slru_;
  std::shared_mutex mu_;
  std::vector<std::unique_ptr<RequestState>> table_;
  std::vector<int64_t> free_;
};

}  // namespace

PYBIND11_MODULE(_native_hotcache, m) {
  m.doc() = "Native hot top-k cache (exact LRU or segmented LRU per request and layer); see kvcore.hotcache.";
  m.attr("MAX_TOKEN") = kMaxToken;
  m.def("max_threads", []() { return omp_get_max_threads(); });
  py::class_<Cache>(m, "Cache")
      .def(py::init<int64_t, int64_t, int64_t>(), py::arg("capacity"), py::arg("num_layers"),
           py::arg("policy"))
      .def("alloc", &Cache::alloc, py::call_guard<py::gil_scoped_release>())
      .def("free", &Cache::free, py::arg("handle"), py::call_guard<py::gil_scoped_release>())
      .def("residency", &Cache::residency, py::arg("handle"), py::arg("layer"),
           py::call_guard<py::gil_scoped_release>())
      .def("resolve", &Cache::resolve, py::arg("layer"), py::arg("handles"), py::arg("topk_ptr"),
           py::arg("k"), py::arg("topk_is_int64"), py::arg("stable_lens"), py::arg("slots_ptr"),
           py::arg("miss_rows_ptr"), py::arg("miss_tokens_ptr"), py::arg("miss_slots_ptr"));
}
