// kvcore._native_hotcache: per-(request, layer) hot top-k residency (exact LRU, segmented LRU or
// CLOCK), C++/OpenMP.
//
// The semantics are defined in kvcore/hotcache.py's module docstring and mirrored line by line by
// its Python reference; tests require identical outputs. This file owns only the fast path:
//   Cache(capacity, num_layers, policy)   native state of one HotCache (policy 0 = "lru",
//                                 1 = "slru", 2 = "clock"); requests are integer handles.
//   alloc() -> handle, free(handle), residency(handle, layer) -> [(token, slot)]
//   resident(layer, handles, tokens_ptr, n, out_ptr)   read-only: out[r, j] = 1 iff token
//           tokens[r, j] (int64, [rows, n]) is resident in (handles[r], layer); handle -1 = none
//   resolve(layer, handles, topk, stable_lens) -> (slots, miss_rows, miss_tokens, miss_slots,
//           num_hits, num_misses): topk a CPU [rows, k] int32/int64 tensor; the outputs are
//           created here (ATen), so that a call is one trip from Python: its tensor calls (four
//           outputs, three sized to the misses) cost more than the kernel's own work at a batch of
//           a few requests once other work has evicted their code from the caches.
// resident's pointers are data_ptr() integers of CPU tensors validated by the Python wrapper
// (dtype, contiguity, shapes). Every input of resolve is re-checked here before any state changes
// (the wrapper checks them first, with the messages its reference path gives), and an error is
// raised as ValueError naming the argument, the position and the value. The GIL is released while
// rows are processed (OpenMP over rows: each row is a different request).
//
// Structure. Per (request, layer): per slot its token and a stamp (where its one live list entry
// is), the dense token -> slot map (16-bit entries when the capacity allows: half the cold bytes
// a step reads), and the LRU lists (probation; protected under "slru"). A list,
// least recent first, is ring ++ last step's block ++ this step's block:
// - a block: the slots moved to the list's most-recent end in one step, in order. A hit is one
//   stamp read, one stamp write and one sequential append (the doubly-linked lists this replaced
//   relinked four nodes at random addresses per hit, the main cost at high overlap).
// - the ring: a lazy-deletion queue (absolute positions [head, tail) in a power-of-two array) of
//   the slots not moved in the last step. After the hits of a step, the last block's entries still
//   live (not moved again) are appended to it in order; then every slot not selected in this step
//   is in a ring, so the misses' victims are the first live ring entries (probation's, then under
//   "slru" protected's). An emptied slot goes to the least-recent end: prepended at --head.
// An entry is live iff its slot's stamp names it; entries of slots that moved on stay behind,
// stale, and are skipped (a ring that cannot take a step's pushes is compacted first: rare, it
// only receives what the blocks leave). Per step a row passes twice over its k entries (lookup:
// map entries fetched ahead, and the stamps along the way, as they are cold when a call starts;
// hits), once over the last block (transfer), then places the misses (their victims collected
// first, branch-free). On x86 with AVX2 (checked at run time) the validation scan and the lookup
// run 8 entries at a time.
//
// "clock" keeps no lists and no stamps: per slot one 16-bit word, (the epoch of the last step
// that selected the slot << 1) | its reference bit, and one hand. A step is the same lookup, one
// pass over the hits (one word write each), then the hand's sweep for the misses; "selected in
// this step" is an epoch compare, so nothing is reset between steps (only when the 15-bit epoch
// wraps: every word's epoch to 0, once per 32767 steps of a (request, layer)).
//
// Threading contract: calls may run concurrently from several Python threads provided they touch
// disjoint (request, layer) pairs (e.g. different layers). alloc/free take the table lock
// exclusively; resolve holds it shared.

#include <torch/extension.h>  // ATen tensors, and the pybind11 torch builds with
#include <pybind11/stl.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define KV_X86 1
#define KV_AVX2 __attribute__((target("avx2,popcnt")))
#endif

namespace py = pybind11;

namespace {

// Largest accepted token index: the token->slot map is a dense array indexed by int32 tokens
// (16-bit entries up to kNarrowSlots slots, else 32-bit).
constexpr int64_t kMaxToken = 2147483646;  // INT32_MAX - 1

constexpr int kProbation = 0, kProtected = 1;
constexpr int64_t kLru = 0, kSlruPolicy = 1, kClock = 2;  // policy codes (kvcore.hotcache.POLICIES)
constexpr uint16_t kMaxEpoch = 32767;  // "clock": epochs 1..kMaxEpoch (15 bits)

// Capacities up to this use a 16-bit token -> slot map: half the bytes of the structure a step
// reads most, and mostly cold when it starts (its other layers and torch ran since).
constexpr int32_t kNarrowSlots = 32766;  // list ids ("lru" only uses probation)

// Where a slot's live entry is: (index << 3) | (region << 1) | list, truncated to the stamp type;
// region 0 = the list's ring (index = absolute position), 1 + b = the list's block array b
// (index in it). 32 bits compare exactly while ring positions of one window differ by < 2^29;
// larger capacities use 64 bits (LayerState::wide).
template <typename Stamp>
inline Stamp stamp_of(int64_t index, int region, int list) {
  return static_cast<Stamp>((static_cast<uint64_t>(index) << 3) | (region << 1) | list);
}

// One LRU list, least recent first: ring ++ last step's block ++ this step's block.
// - ring: a lazy-deletion queue, the slots not moved to the most-recent end in the last step;
//   entry of absolute position p at ring[p & mask], live ones among [head, tail).
// - blk[cur] (`last` entries): the slots moved to the most-recent end in the last step, in order;
//   this step's moves go to blk[cur ^ 1]. Between hits and misses the last step's block entries
//   still live (not moved again) are appended to the ring; at the end of the step the blocks swap.
struct List {
  std::vector<int32_t> ring;  // [mask + 1], a power of two
  int64_t mask = 0, head = 0, tail = 0;
  std::vector<int32_t> blk[2];  // [cap] each
  int cur = 0;
  int64_t last = 0;

  void init(int64_t ring_entries, int32_t cap) {
    ring.assign(static_cast<size_t>(ring_entries), 0);
    mask = ring_entries - 1;
    blk[0].assign(static_cast<size_t>(cap), 0);
    blk[1].assign(static_cast<size_t>(cap), 0);
  }
  int64_t room() const { return mask + 1 - (tail - head); }
};

// Ring entries per list: a power of two >= 4x capacity. After a compaction a ring holds at most
// `capacity` entries, which leaves room for a step's pushes (the last block, <= capacity, plus
// <= k speculative misses) and for step 1 (<= capacity).
int64_t ring_size(int64_t cap) {
  int64_t n = 1;
  while (n < 4 * cap) n <<= 1;
  return n;
}

constexpr int64_t kLookAhead = 64;  // top-k entries whose map entries are fetched ahead
constexpr int64_t kPrefetch = 16;   // entries fetched ahead by compact() and the misses

// Fetches the lines of an array spread over the n iterations of a loop (line l by iteration
// l * n / lines), so that they arrive while the loop works on other data: the state a later
// pass reads at random (the stamps) is cold when a call starts (the other rows, the other layers
// and torch ran since this row's last step).
struct Warm {
  Warm(const void* p, int64_t bytes, int64_t n)
      : base(static_cast<const char*>(p)), lines((bytes + 63) / 64), n(n) {}
  void upto(int64_t i) {  // the lines due by iteration i
    for (; next < lines && next * n < lines * i; ++next) __builtin_prefetch(base + 64 * next, 1);
  }
  const char* base;
  int64_t lines, n, next = 0;
};

// -1 <= t <= kMaxToken iff (t + 1) as unsigned < 2^31: OR those (returned) and test one bit. The
// maximum is taken over the low 32 bits (exact once valid), so the loop vectorizes.
template <typename T>
inline __attribute__((always_inline)) std::make_unsigned_t<T> scan_row(const T* __restrict topk,
                                                                  int64_t k, int32_t* hi_out) {
  using U = std::make_unsigned_t<T>;
  U bits = 0;
  int32_t hi = -1;
  for (int64_t j = 0; j < k; ++j) {
    const T t = topk[j];
    bits |= static_cast<U>(t) + 1;
    const int32_t t32 = static_cast<int32_t>(t);
    hi = t32 > hi ? t32 : hi;
  }
  *hi_out = hi;
  return bits;
}

#ifdef KV_X86
// x86 kernels compiled for AVX2 (the build targets baseline x86-64), taken when the CPU has it
// (kHasAvx2); each computes exactly what the portable loop it replaces does.

template <typename T>
KV_AVX2 std::make_unsigned_t<T> scan_row_avx2(const T* __restrict topk, int64_t k, int32_t* hi_out) {
  return scan_row<T>(topk, k, hi_out);  // the portable loop, inlined here and compiled for AVX2
}

const bool kHasAvx2 = [] {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt");
}();

// kCompress[m]: the indices of the set bits of the 8-bit mask m, as bytes (low byte first);
// with vpermd it packs the selected lanes of a vector to its front.
struct CompressTable {
  uint64_t idx[256];
  CompressTable() {
    for (int m = 0; m < 256; ++m) {
      uint64_t v = 0;
      int n = 0;
      for (int b = 0; b < 8; ++b)
        if (m >> b & 1) v |= static_cast<uint64_t>(b) << (8 * n++);
      idx[m] = v;
    }
  }
};
const CompressTable kCompress;

KV_AVX2 inline __m256i compress_perm(unsigned m) {
  return _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(kCompress.idx[m])));
}

// The lookup of resolve_row, 8 entries per step (one gather): slots[j] = max(map[t[j]], -1), the
// positions with map[t[j]] == -1 packed into miss_pos; returns their number. Fetches ahead like
// the portable loop.
// A 16-bit map is gathered 32 bits at a time (the entry and the next one: the map has one spare
// entry at its end) and sign-extended from the low half.
template <typename T, typename Map>
KV_AVX2 int64_t lookup_avx2(const T* __restrict topk, int64_t k, const Map* __restrict ts,
                            int32_t* __restrict slots, int32_t* __restrict miss_pos, Warm& warm) {
  constexpr int kScale = sizeof(Map);
  const int* base = reinterpret_cast<const int*>(ts);
  const __m256i minus1 = _mm256_set1_epi32(-1), lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  int64_t nm = 0, j = 0;
  for (; j + 8 <= k; j += 8) {
    for (int64_t a = j + kLookAhead; a < std::min(j + kLookAhead + 8, k); ++a)
      __builtin_prefetch(ts + static_cast<int64_t>(topk[a]));
    warm.upto(j + 8);
    __m256i s;
    if constexpr (sizeof(T) == 4) {
      const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(topk + j));
      s = _mm256_i32gather_epi32(base, t, kScale);
    } else {
      const __m256i t0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(topk + j));
      const __m256i t1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(topk + j + 4));
      s = _mm256_set_m128i(_mm256_i64gather_epi32(base, t1, kScale), _mm256_i64gather_epi32(base, t0, kScale));
    }
    if constexpr (sizeof(Map) == 2) s = _mm256_srai_epi32(_mm256_slli_epi32(s, 16), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(slots + j), _mm256_max_epi32(s, minus1));
    const unsigned m = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(s, minus1)));
    const __m256i pos = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(j)), lanes);
    // (writes 8 entries at nm <= j: inside the row's k)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(miss_pos + nm),
                        _mm256_permutevar8x32_epi32(pos, compress_perm(m)));
    nm += __builtin_popcount(m);
  }
  for (; j < k; ++j) {
    const int32_t s = ts[static_cast<int64_t>(topk[j])];
    slots[j] = s < -1 ? -1 : s;
    miss_pos[nm] = static_cast<int32_t>(j);
    nm += s == -1;
  }
  return nm;
}

#endif  // KV_X86

// State of one (request, layer): per slot its token and stamp; the probation list (lists[0]) and,
// under "slru", the protected list (lists[1]); the dense token -> slot map. Methods templated on
// `Stamp` use the stamp array in use (`wide`: 64 bits).
struct LayerState {
  LayerState(int32_t capacity, int64_t policy)
      : cap(capacity), wide(ring_size(capacity) > (int64_t{1} << 29)), narrow(capacity <= kNarrowSlots),
        token(capacity, -1) {
    if (narrow) token_slot16.assign(2, -2); else token_slot32.assign(1, -2);
    if (policy == kClock) {  // new state: every slot empty, its word 0 (epoch 0, bit clear), hand 0
      clock.assign(static_cast<size_t>(capacity), 0);
      return;
    }
    const bool slru = policy == kSlruPolicy;
    if (wide) stamp64.resize(capacity); else stamp32.resize(capacity);
    lists[kProbation].init(ring_size(capacity), capacity);
    if (slru) lists[kProtected].init(ring_size(capacity), capacity);
    // New state: probation from least recent 0, 1, ..., capacity-1; protected empty.
    for (int32_t s = 0; s < cap; ++s) {
      if (wide) push_back<uint64_t>(kProbation, s); else push_back<uint32_t>(kProbation, s);
    }
  }

  template <typename Stamp>
  Stamp* stamps() {
    if constexpr (sizeof(Stamp) == 4) return stamp32.data(); else return stamp64.data();
  }
  template <typename Stamp>
  void push_back(int list, int32_t s) {  // to the ring's most-recent end
    List& l = lists[list];
    l.ring[l.tail & l.mask] = s;
    stamps<Stamp>()[s] = stamp_of<Stamp>(l.tail++, 0, list);
  }
  template <typename Stamp>
  void push_front(int32_t s) {  // to the least-recent end of probation
    List& l = lists[kProbation];
    --l.head;
    l.ring[l.head & l.mask] = s;
    stamps<Stamp>()[s] = stamp_of<Stamp>(l.head, 0, kProbation);
  }
  template <typename Map>
  Map* map() {  // map<Map>()[t]: slot of token t >= -1 (the map in use, by `narrow`)
    if constexpr (sizeof(Map) == 2) return token_slot16.data() + 1; else return token_slot32.data() + 1;
  }
  int64_t mapped() const {  // tokens the map covers
    return narrow ? static_cast<int64_t>(token_slot16.size()) - 2 : static_cast<int64_t>(token_slot32.size()) - 1;
  }
  int32_t slot_of(int64_t t) const {  // the map entry of token 0 <= t < mapped()
    return narrow ? token_slot16[static_cast<size_t>(t) + 1] : token_slot32[static_cast<size_t>(t) + 1];
  }
  template <typename Stamp, typename Map>
  void empty_slot(int32_t s) {
    map<Map>()[token[s]] = -1;
    token[s] = -1;
    push_front<Stamp>(s);
  }
  template <typename Map>
  void empty_clock_slot(int32_t s) {  // "clock": the slot empty, its reference bit clear
    map<Map>()[token[s]] = -1;
    token[s] = -1;
    clock[s] &= static_cast<uint16_t>(~1u);
  }
  uint16_t next_epoch() {  // "clock": this step's epoch; on wrap every word's epoch goes to 0 first
    if (epoch == kMaxEpoch) {
      for (uint16_t& w : clock) w &= 1;
      epoch = 0;
    }
    return ++epoch;
  }
  // "clock": the hand's sweep for one miss, one slot at a time (kvcore/hotcache.py, step 3).
  int32_t clock_sweep(uint16_t now) {
    for (;;) {
      const int32_t h = hand;
      const uint16_t w = clock[h];
      hand = h + 1 == cap ? 0 : h + 1;
      if ((w >> 1) == now) continue;
      if ((w & 1) == 0) return h;
      clock[h] = static_cast<uint16_t>(w & ~1u);
    }
  }
  // "clock": the victims the sweep would take while no slot changes: the slots from the hand on,
  // within one turn, with a clear bit (before any miss of a step, the slots selected in it are
  // its hits: their bits are set), up to `want`; branch-free (the slot is written every time and
  // kept by advancing n). Changes nothing.
  int64_t clock_collect(int64_t want, int32_t* __restrict out) const {
    const uint16_t* __restrict w = clock.data();
    int64_t n = 0;
    int32_t p = hand;
    for (int32_t looked = 0; n < want && looked < cap; ++looked) {
      out[n] = p;
      n += ~w[p] & 1u;
      p = p + 1 == cap ? 0 : p + 1;
    }
    return n;
  }
  // "clock": what the sweep does to the n slots from `from` on (mod cap) that it passes: the set
  // bit of each slot not selected in this step cleared. Branch-free, two contiguous runs.
  void clock_clear(uint16_t now, int32_t from, int64_t n) {
    uint16_t* __restrict w = clock.data();
    const int64_t first = std::min<int64_t>(n, cap - from);
    for (int pass = 0; pass < 2; ++pass) {
      const int64_t lo = pass == 0 ? from : 0, hi = pass == 0 ? from + first : n - first;
      for (int64_t p = lo; p < hi; ++p)
        w[p] = static_cast<uint16_t>(w[p] & ~static_cast<unsigned>((w[p] >> 1) != now));
    }
  }
  // Appends the live entries of the last step's block to the ring, in order: a branch-free
  // compaction (live and stale entries interleave at random; the ring has room for the one write
  // past them, see reserve), then the stamps of the appended ones.
  template <typename Stamp>
  void transfer(int list) {
    List& l = lists[list];
    const int32_t* __restrict blk = l.blk[l.cur].data();
    int32_t* __restrict ring = l.ring.data();
    Stamp* __restrict st = stamps<Stamp>();
    const int64_t mask = l.mask, n = l.last, tail0 = l.tail;
    int64_t tail = tail0;
    Stamp expect = stamp_of<Stamp>(0, l.cur + 1, list);
    for (int64_t i = 0; i < n; ++i) {
      const int32_t s = blk[i];
      ring[tail & mask] = s;
      tail += st[s] == expect;
      expect += 8;
    }
    for (int64_t p = tail0; p < tail; ++p) st[ring[p & mask]] = stamp_of<Stamp>(p, 0, list);
    l.tail = tail;
    l.last = 0;
  }
  // Drops a ring's stale entries: its live entries move down, in order, to [head, head + live).
  // In place (a write never passes the read), then the stamps of the moved ones, like transfer().
  template <typename Stamp>
  void compact(int list) {
    List& l = lists[list];
    int32_t* __restrict ring = l.ring.data();
    Stamp* __restrict st = stamps<Stamp>();
    const int64_t mask = l.mask, head = l.head, tail = l.tail;
    int64_t n = head;
    for (int64_t p = head; p < tail; ++p) {
      if (p + kPrefetch < tail) __builtin_prefetch(st + ring[(p + kPrefetch) & mask]);
      const int32_t s = ring[p & mask];
      const bool live = st[s] == stamp_of<Stamp>(p, 0, list);
      ring[n & mask] = s;
      n += live;
    }
    for (int64_t p = head; p < n; ++p) st[ring[p & mask]] = stamp_of<Stamp>(p, 0, list);
    l.tail = n;
  }
  // Collects the live entries of a ring from its head into slot[*n..], pos[*n..] until *n == want
  // or the ring is exhausted; returns the position where the scan stopped. Branch-free: the
  // entry is written every time and kept by advancing *n.
  template <typename Stamp>
  int64_t collect(int list, int64_t want, int32_t* __restrict slot, int64_t* __restrict pos,
                  int64_t* n_io) {
    const List& l = lists[list];
    const int32_t* __restrict ring = l.ring.data();
    const Stamp* __restrict st = stamps<Stamp>();
    const int64_t mask = l.mask, tail = l.tail;
    int64_t n = *n_io, p = l.head;
    for (; n < want && p < tail; ++p) {
      const int32_t s = ring[p & mask];
      slot[n] = s;
      pos[n] = p;
      n += st[s] == stamp_of<Stamp>(p, 0, list);
    }
    *n_io = n;
    return p;
  }
  template <typename Stamp>
  void reserve(int list, int64_t n) {  // ring room for n pushes
    if (lists[list].room() < n) compact<Stamp>(list);
  }
  void ensure_token(int64_t max_token) {
    const int64_t size = mapped();
    if (max_token < size) return;
    int64_t n = std::max<int64_t>(max_token + 1, 2 * size);
    n = std::min<int64_t>(n, kMaxToken + 1);
    if (narrow) {  // [-2, map..., spare]: the spare keeps the 32-bit gather of the last entry inside
      token_slot16.back() = -1;
      token_slot16.resize(static_cast<size_t>(n + 2), -1);
    } else {
      token_slot32.resize(static_cast<size_t>(n + 1), -1);
    }
  }

  int32_t cap;
  bool wide;                        // 64-bit stamps (rings past 2^29 entries)
  bool narrow;                      // 16-bit token -> slot map (capacity <= kNarrowSlots)
  std::vector<int32_t> token;       // [cap] slot -> token, -1 = empty
  std::vector<uint32_t> stamp32;    // [cap] slot -> stamp_of its live entry: one of the two
  std::vector<uint64_t> stamp64;    //   (by `wide`)
  List lists[2];                    // probation, protected (allocated under "slru" only)
  std::vector<uint16_t> clock;      // "clock" only: [cap] (epoch last selected << 1) | reference bit
  int32_t hand = 0;                 // "clock": the next slot the hand looks at
  uint16_t epoch = 0;               // "clock": the last step's epoch
  std::vector<int32_t> token_slot32;  // [1 + tokens]: -2 (what padding -1 looks up), then the
                                      // dense token -> slot map, -1 = absent (see map())
  std::vector<int16_t> token_slot16;  // narrow: the same in 16 bits, plus one spare entry at the end
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
Error check_row(const T* __restrict topk, int64_t k, int64_t r, int64_t stable, int64_t* max_token) {
  Error e;
  if (stable < 0) {
    e.kind = 1; e.row = r; e.value = stable;
    return e;
  }
  int32_t hi;
#ifdef KV_X86
  const auto bits = kHasAvx2 ? scan_row_avx2<T>(topk, k, &hi) : scan_row<T>(topk, k, &hi);
#else
  const auto bits = scan_row<T>(topk, k, &hi);
#endif
  if (bits >> 31) {  // locate the culprit only on error
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

constexpr int64_t kParallelEntries = 4096;  // fewer top-k entries per call: one thread

// Lookup of one row, branch-free: slots[j] = the slot of t[j], -1 unless resident (padding reads
// the -2 in front of the map); the absent positions (-1) are listed in miss_pos; returns their
// number. Map entries are fetched kLookAhead positions ahead, and `warm`'s array along the way.
template <typename T, typename Map>
int64_t lookup_row(const T* __restrict topk, int64_t k, const Map* __restrict ts, int32_t* __restrict slots,
                   int32_t* __restrict miss_pos, Warm& warm) {
  int64_t nm = 0;
#ifdef KV_X86
  if (kHasAvx2) {
    nm = lookup_avx2<T, Map>(topk, k, ts, slots, miss_pos, warm);
  } else
#endif
  {
    const int64_t k_ahead = std::max<int64_t>(k - kLookAhead, 0);
    for (int64_t j = 0; j < k; ++j) {
      if (j < k_ahead) __builtin_prefetch(ts + static_cast<int64_t>(topk[j + kLookAhead]));
      if ((j & 7) == 0) warm.upto(j + 8);
      const int32_t s = ts[static_cast<int64_t>(topk[j])];
      slots[j] = s < -1 ? -1 : s;
      miss_pos[nm] = static_cast<int32_t>(j);
      nm += s == -1;
    }
  }
  warm.upto(k);
  return nm;
}

// One step of one row; semantics in kvcore/hotcache.py. Returns (hits, misses); misses are
// written in order of first top-k occurrence to the miss_* arrays (row-local region of k entries;
// miss_rows doubles as the scratch list of miss positions). `spec` is a reusable buffer.
template <typename T, bool kSlru, typename Stamp, typename Map>
std::pair<int64_t, int64_t> resolve_row(LayerState& st, const T* __restrict topk, int64_t k,
                                        int64_t stable, int32_t row, int32_t* __restrict slots,
                                        int32_t* __restrict miss_rows,
                                        int64_t* __restrict miss_tokens,
                                        int32_t* __restrict miss_slots, std::vector<int32_t>& spec) {
  constexpr int kHitList = kSlru ? kProtected : kProbation;
  const int32_t cap = st.cap;
  List& prob = st.lists[kProbation];
  List& hl = st.lists[kHitList];
  // (1) Drop tokens >= stable (only possible when the stable length shrank).
  if (stable < st.resident_bound) {
    st.reserve<Stamp>(kProbation, cap);
    for (int32_t s = 0; s < cap; ++s)
      if (st.token[s] >= stable) st.empty_slot<Stamp, Map>(s);
  }
  // Ring room for this step: the last blocks' live entries, <= k speculative misses to the
  // least-recent end of probation, and the one spare write of transfer().
  st.reserve<Stamp>(kProbation, prob.last + k + 1);
  if (kSlru) st.reserve<Stamp>(kProtected, hl.last + 1);
  Stamp* __restrict stamp = st.stamps<Stamp>();
  Map* __restrict ts = st.map<Map>();
  int32_t* __restrict token = st.token.data();
  // Lookup (the stamps, read by (2), fetched along the way).
  Warm warm_stamps(stamp, static_cast<int64_t>(cap) * static_cast<int64_t>(sizeof(Stamp)), k);
  const int64_t nm = lookup_row<T, Map>(topk, k, ts, slots, miss_rows, warm_stamps);
  // (2) A hit's slot moves to the most-recent end of the hit list (its new block) unless it
  // already did in this step, i.e. its stamp is in that block (low 3 bits == mark). (Measured:
  // branches beat a branch-free form here.)
  const int hregion = (hl.cur ^ 1) + 1;
  int32_t* __restrict hblk = hl.blk[hl.cur ^ 1].data();
  const Stamp mark = stamp_of<Stamp>(0, hregion, kHitList);
  int64_t hits = 0;
  for (int64_t j = 0; j < k; ++j) {
    const int32_t s = slots[j];
    if (s >= 0 && (stamp[s] & 7) != mark) {
      hblk[hits] = s;
      stamp[s] = stamp_of<Stamp>(hits, hregion, kHitList);
      ++hits;
    }
  }
  // The last step's blocks go to the rings: every slot not selected in this step is now in a
  // ring, least recent first, and every selected one in a new block.
  st.transfer<Stamp>(kProbation);
  if (kSlru) st.transfer<Stamp>(kProtected);
  // (3) Misses take the least-recent slot and enter probation (its new block, after the hits
  // under "lru"); duplicates reuse the slot taken in this step. The victims are the live entries
  // of probation's ring from its head, then under "slru" (probation empty or all selected) those
  // of protected's ring (enough of them: unique tokens <= capacity). Up to nm of them are
  // collected first, branch-free (their stamps load in parallel): slots in miss_slots, ring
  // positions in miss_tokens, each read before the miss of its index overwrites it.
  int32_t* const vslot = miss_slots;
  int64_t* const vpos = miss_tokens;
  int64_t nv = 0;
  const int64_t pend = st.collect<Stamp>(kProbation, nm, vslot, vpos, &nv);
  const int64_t nprob = nv;
  if (kSlru && nv < nm) st.collect<Stamp>(kProtected, nm, vslot, vpos, &nv);
  const int pregion = (prob.cur ^ 1) + 1;
  int32_t* __restrict pblk = prob.blk[prob.cur ^ 1].data();
  int64_t np = kSlru ? 0 : hits, misses = 0, nspec = 0, last_pos = 0;
  for (int64_t i = 0; i < nm; ++i) {
    const int64_t j = miss_rows[i];  // read before miss_rows[misses <= i] is written
    const int64_t t = static_cast<int64_t>(topk[j]);
    int32_t s = ts[t];
    if (s < 0) {
      if (misses + kPrefetch < nv) __builtin_prefetch(token + vslot[misses + kPrefetch]);
      if (misses + kPrefetch / 2 < nv) __builtin_prefetch(ts + token[vslot[misses + kPrefetch / 2]], 1);
      s = vslot[misses];
      last_pos = vpos[misses];
      const int32_t old = token[s];
      ts[old] = static_cast<Map>(old < 0 ? -2 : -1);  // (an empty slot's -1 reads the padding entry: keep it)
      token[s] = static_cast<int32_t>(t);
      ts[t] = static_cast<Map>(s);
      pblk[np] = s;
      stamp[s] = stamp_of<Stamp>(np, pregion, kProbation);
      ++np;
      miss_rows[misses] = row;
      miss_tokens[misses] = t;
      miss_slots[misses] = s;
      ++misses;
      nspec += t >= stable;
    }
    slots[j] = s;
  }
  // Pop the victims taken (and the stale entries before them).
  if (misses > 0) {
    if (misses <= nprob) {
      prob.head = last_pos + 1;
    } else {
      prob.head = pend;
      st.lists[kProtected].head = last_pos + 1;
    }
  }
  // (4) Speculative tokens loaded in this step do not stay resident.
  if (nspec > 0) {
    spec.clear();
    for (int64_t m = 0; m < misses; ++m)
      if (miss_tokens[m] >= stable) spec.push_back(miss_slots[m]);
    std::sort(spec.begin(), spec.end());
    for (int32_t s : spec) st.empty_slot<Stamp, Map>(s);
  }
  // This step's blocks become the last ones.
  prob.cur ^= 1;
  prob.last = np;
  if (kSlru) {
    hl.cur ^= 1;
    hl.last = hits;
  }
  st.resident_bound = stable;
  return {hits, misses};
}

// One step of one row under "clock"; semantics in kvcore/hotcache.py, outputs as resolve_row's.
// A word's epoch == this step's: the slot was selected in this step (hit, or taken by a miss).
template <typename T, typename Map>
std::pair<int64_t, int64_t> resolve_row_clock(LayerState& st, const T* __restrict topk, int64_t k,
                                              int64_t stable, int32_t row, int32_t* __restrict slots,
                                              int32_t* __restrict miss_rows,
                                              int64_t* __restrict miss_tokens,
                                              int32_t* __restrict miss_slots, std::vector<int32_t>& spec) {
  const int32_t cap = st.cap;
  // (1) Drop tokens >= stable (only possible when the stable length shrank).
  if (stable < st.resident_bound)
    for (int32_t s = 0; s < cap; ++s)
      if (st.token[s] >= stable) st.empty_clock_slot<Map>(s);
  const uint16_t now = st.next_epoch();
  const uint16_t sel = static_cast<uint16_t>(now << 1);
  uint16_t* __restrict word = st.clock.data();
  Map* __restrict ts = st.map<Map>();
  int32_t* __restrict token = st.token.data();
  Warm warm_words(word, static_cast<int64_t>(cap) * 2, k);
  const int64_t nm = lookup_row<T, Map>(topk, k, ts, slots, miss_rows, warm_words);
  // (2) A hit sets its slot's reference bit and marks it selected; counted on its first occurrence.
  int64_t hits = 0;
  for (int64_t j = 0; j < k; ++j) {
    const int32_t s = slots[j];
    if (s >= 0) {
      hits += (word[s] >> 1) != now;
      word[s] = static_cast<uint16_t>(sel | 1);
    }
  }
  // (3) A miss takes the first slot from the hand on that is not selected in this step and whose
  // bit is clear, clearing the set bits the hand passes; duplicates reuse the slot taken in this
  // step. The victims are collected first (up to nm, within one turn of the hand; misses do not
  // change which slots ahead of the hand qualify); once the misses are placed, the bits of the
  // slots the hand passed are cleared and it moves one past the last victim. Rarely one turn has
  // too few: then the sweep runs slot by slot from the hand (it passes the first turn again,
  // whose qualifying slots are all taken now, clearing its bits), and the clearing after it
  // changes nothing more.
  const int32_t hand0 = st.hand;
  int32_t* const victim = miss_slots;  // victim[m] is read before miss m writes miss_slots[m]
  const int64_t nv = nm > 0 ? st.clock_collect(nm, victim) : 0;
  int64_t misses = 0, nspec = 0;
  for (int64_t i = 0; i < nm; ++i) {
    const int64_t j = miss_rows[i];  // read before miss_rows[misses <= i] is written
    const int64_t t = static_cast<int64_t>(topk[j]);
    int32_t s = ts[t];
    if (s < 0) {
      if (misses < nv) {
        if (misses + kPrefetch < nv) __builtin_prefetch(token + victim[misses + kPrefetch]);
        if (misses + kPrefetch / 2 < nv) __builtin_prefetch(ts + token[victim[misses + kPrefetch / 2]], 1);
        s = victim[misses];
      } else {
        s = st.clock_sweep(now);  // (st.hand is still hand0)
      }
      const int32_t old = token[s];
      ts[old] = static_cast<Map>(old < 0 ? -2 : -1);  // (an empty slot's -1 reads the padding entry: keep it)
      token[s] = static_cast<int32_t>(t);
      ts[t] = static_cast<Map>(s);
      word[s] = sel;  // selected, its bit clear: a new token's bit starts clear
      miss_rows[misses] = row;
      miss_tokens[misses] = t;
      miss_slots[misses] = s;
      ++misses;
      nspec += t >= stable;
    }
    slots[j] = s;
  }
  if (misses > 0) {
    const int32_t last = miss_slots[misses - 1];
    st.clock_clear(now, hand0, (last - hand0 + cap) % cap + 1);
    st.hand = last + 1 == cap ? 0 : last + 1;
  }
  // (4) Speculative tokens loaded in this step do not stay resident.
  if (nspec > 0) {
    spec.clear();
    for (int64_t m = 0; m < misses; ++m)
      if (miss_tokens[m] >= stable) spec.push_back(miss_slots[m]);
    for (const int32_t s : spec) st.empty_clock_slot<Map>(s);
  }
  st.resident_bound = stable;
  return {hits, misses};
}

class Cache {
 public:
  Cache(int64_t capacity, int64_t num_layers, int64_t policy)
      : cap_(capacity), num_layers_(num_layers), policy_(policy) {
    if (policy != kLru && policy != kSlruPolicy && policy != kClock)
      throw py::value_error("policy = " + std::to_string(policy) + " must be 0 (lru), 1 (slru) or 2 (clock)");
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
      if (st->token[s] >= 0) out.emplace_back(st->token[s], s);
    return out;
  }

  // Read-only residency test (module comment): never allocates or changes state, so it may run
  // while another thread resolves a different layer.
  void resident(int64_t layer, const std::vector<int64_t>& handles, uintptr_t tokens_ptr, int64_t n,
                uintptr_t out_ptr) {
    check_layer(layer);
    const int64_t rows = static_cast<int64_t>(handles.size());
    const int64_t* tokens = reinterpret_cast<const int64_t*>(tokens_ptr);
    uint8_t* out = reinterpret_cast<uint8_t*>(out_ptr);
    py::gil_scoped_release release;
    std::shared_lock<std::shared_mutex> lock(mu_);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t h = handles[r];
      const LayerState* st = h >= 0 && h < static_cast<int64_t>(table_.size()) && table_[h]
                                 ? table_[h]->layers[layer].get()
                                 : nullptr;
      const int64_t* t = tokens + r * n;
      uint8_t* o = out + r * n;
      if (st == nullptr) {
        std::fill(o, o + n, uint8_t{0});
        continue;
      }
      const int64_t mapped = st->mapped();
      for (int64_t j = 0; j < n; ++j) o[j] = t[j] >= 0 && t[j] < mapped && st->slot_of(t[j]) >= 0;
    }
  }

  py::tuple resolve(int64_t layer, const std::vector<int64_t>& handles, const at::Tensor& topk,
                    const std::vector<int64_t>& stable) {
    check_layer(layer);
    const auto dtype = topk.scalar_type();
    if (dtype != at::kInt && dtype != at::kLong)
      throw py::value_error(std::string("topk must be an int32 or int64 tensor, got ") + c10::toString(dtype));
    if (!topk.device().is_cpu() || topk.dim() != 2 || !topk.is_contiguous())
      throw py::value_error("topk must be a contiguous CPU [rows, k] tensor");
    const int64_t rows = topk.size(0), k = topk.size(1);
    if (static_cast<int64_t>(handles.size()) != rows)
      throw py::value_error("request_ids has " + std::to_string(handles.size()) + " entries but topk has " +
                            std::to_string(rows) + " rows");
    const auto i32 = at::TensorOptions().dtype(at::kInt);
    at::Tensor slots = at::empty({rows, k}, i32), miss_rows = at::empty({rows * k}, i32),
               miss_tokens = at::empty({rows * k}, at::TensorOptions().dtype(at::kLong)),
               miss_slots = at::empty({rows * k}, i32);
    const auto [hits, misses] =
        resolve_rows(layer, handles, topk.data_ptr(), k, dtype == at::kLong, stable, slots.data_ptr<int32_t>(),
                     miss_rows.data_ptr<int32_t>(), miss_tokens.data_ptr<int64_t>(), miss_slots.data_ptr<int32_t>());
    miss_rows.resize_({misses});  // in place, same storage: what [:misses] gives, cheaper
    miss_tokens.resize_({misses});
    miss_slots.resize_({misses});
    return py::make_tuple(slots, miss_rows, miss_tokens, miss_slots, hits, misses);
  }

 private:
  std::pair<int64_t, int64_t> resolve_rows(int64_t layer, const std::vector<int64_t>& handles, const void* topk,
                                           int64_t k, bool topk_is_int64, const std::vector<int64_t>& stable,
                                           int32_t* slots, int32_t* miss_rows, int64_t* miss_tokens,
                                           int32_t* miss_slots) {
    const int64_t rows = static_cast<int64_t>(handles.size());
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
          err = run<int64_t>(layer, handles, static_cast<const int64_t*>(topk), k, stable.data(), slots,
                             miss_rows, miss_tokens, miss_slots, &hits, &misses);
        else
          err = run<int32_t>(layer, handles, static_cast<const int32_t*>(topk), k, stable.data(), slots,
                             miss_rows, miss_tokens, miss_slots, &hits, &misses);
      }
    }
    if (err.kind != 0) throw py::value_error(message(err));
    return {hits, misses};
  }

  template <typename T>
  Error run(int64_t layer, const std::vector<int64_t>& handles, const T* topk, int64_t k,
            const int64_t* stable, int32_t* slots, int32_t* miss_rows, int64_t* miss_tokens,
            int32_t* miss_slots, int64_t* hits_out, int64_t* misses_out) {
    const int64_t rows = static_cast<int64_t>(handles.size());
    std::vector<int64_t> per_row(static_cast<size_t>(3 * rows), 0);
    int64_t* max_token = per_row.data();  // [rows]
    int64_t* row_hits = max_token + rows;  // [rows]
    int64_t* row_misses = row_hits + rows;  // [rows]
    // Validate every row before touching any state (serial: cheaper than a fork/join).
    for (int64_t r = 0; r < rows; ++r) {
      const Error e = check_row<T>(topk + r * k, k, r, stable[r], &max_token[r]);
      if (e.kind != 0) return e;
    }
    // Allocate here (may throw) so that the parallel part cannot fail.
    std::vector<LayerState*> states(rows);
    for (int64_t r = 0; r < rows; ++r) {
      auto& slot = table_[handles[r]]->layers[layer];
      if (!slot) slot = std::make_unique<LayerState>(static_cast<int32_t>(cap_), policy_);
      slot->ensure_token(std::max<int64_t>(max_token[r], 0));
      states[r] = slot.get();
    }
    // Static schedule (thread t takes the t-th contiguous share of the rows; one thread: no team
    // at all): with the same batch a row (request) stays on its thread, its state in that
    // core's cache. Threads come from the process's OpenMP runtime (torch's libgomp when torch is
    // loaded first), so they are the threads torch's own ops just used. Measured trade-off: a
    // private work-claiming pool was robust when other processes held a core (libgomp's barrier
    // spins ~20 ms before yielding, so a 0.1 ms call can take 12-30 ms then), but it fought
    // torch's spinning OpenMP workers whenever torch ops ran between calls, as in the engine.
    auto work = [&](int64_t lo, int64_t hi) {
      thread_local std::vector<int32_t> spec;  // speculative slots of a row (capacity kept)
      const bool slru = policy_ == kSlruPolicy;
      for (int64_t r = lo; r < hi; ++r) {
        auto step = policy_ == kClock   ? (states[r]->narrow ? resolve_row_clock<T, int16_t>
                                                             : resolve_row_clock<T, int32_t>)
                    : states[r]->wide   ? (slru ? resolve_row<T, true, uint64_t, int32_t>
                                                : resolve_row<T, false, uint64_t, int32_t>)
                    : states[r]->narrow ? (slru ? resolve_row<T, true, uint32_t, int16_t>
                                                : resolve_row<T, false, uint32_t, int16_t>)
                                        : (slru ? resolve_row<T, true, uint32_t, int32_t>
                                                : resolve_row<T, false, uint32_t, int32_t>);
        auto hm = step(*states[r], topk + r * k, k, stable[r], static_cast<int32_t>(r),
                       slots + r * k, miss_rows + r * k, miss_tokens + r * k, miss_slots + r * k,
                       spec);
        row_hits[r] = hm.first;
        row_misses[r] = hm.second;
      }
    };
    const int64_t threads =
        rows > 1 && rows * k >= kParallelEntries ? std::min<int64_t>(omp_get_max_threads(), rows) : 1;
    if (threads <= 1) {
      work(0, rows);
    } else {
#pragma omp parallel num_threads(static_cast<int>(threads))
      {
        const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
        work(rows * t / n, rows * (t + 1) / n);
      }
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
  int64_t policy_;  // kLru, kSlruPolicy or kClock
  std::shared_mutex mu_;
  std::vector<std::unique_ptr<RequestState>> table_;
  std::vector<int64_t> free_;
};

}  // namespace

PYBIND11_MODULE(_native_hotcache, m) {
  m.doc() = "Native hot top-k cache (exact LRU, segmented LRU or CLOCK per request and layer); see kvcore.hotcache.";
  m.attr("MAX_TOKEN") = kMaxToken;
  m.def("max_threads", []() { return omp_get_max_threads(); });
  py::class_<Cache>(m, "Cache")
      .def(py::init<int64_t, int64_t, int64_t>(), py::arg("capacity"), py::arg("num_layers"),
           py::arg("policy"))
      .def("alloc", &Cache::alloc, py::call_guard<py::gil_scoped_release>())
      .def("free", &Cache::free, py::arg("handle"), py::call_guard<py::gil_scoped_release>())
      .def("residency", &Cache::residency, py::arg("handle"), py::arg("layer"),
           py::call_guard<py::gil_scoped_release>())
      .def("resident", &Cache::resident, py::arg("layer"), py::arg("handles"), py::arg("tokens_ptr"),
           py::arg("n"), py::arg("out_ptr"))
      .def("resolve", &Cache::resolve, py::arg("layer"), py::arg("handles"), py::arg("topk"),
           py::arg("stable_lens"));
}
