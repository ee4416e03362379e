// kernels/simt_emulator.cpp — blocks in sequence, threads as Boost.Context fibers.
//
// The scheduler picks a warp with runnable threads — at random (seeded), or the lowest with
// shuffling off — and runs those threads, in shuffled order, each until it blocks at a
// barrier or a warp collective, or ends.
//   1. A warp collective completes as soon as the last lane of its mask arrives: the warp is
//      runnable again at once, so one warp can run ahead of the others (into the next loop
//      iteration, the next row ...) exactly as far as the barriers allow, as on a GPU. In
//      half of the blocks the warp that just ran is favoured ("run-ahead"), which makes
//      such schedules common rather than rare.
//   2. When nothing is runnable: if every live thread waits at the same __syncthreads, the
//      barrier opens;
//   3. otherwise it is an error: divergence, or a warp collective that cannot complete.
#include "kernels/simt_emulator.h"

#include <boost/context/fiber.hpp>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <numeric>
#include <random>
#include <sstream>
#include <cerrno>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define SIMT_ASAN 1
#endif

namespace simt {

namespace ctx = boost::context;

Options& options() {
  static Options opt = [] {
    Options o;
    if (const char* s = std::getenv("SIMT_SHUFFLE")) o.shuffle = std::strcmp(s, "0") != 0;
    if (const char* s = std::getenv("SIMT_SEED")) o.seed = std::strtoull(s, nullptr, 10);
    if (const char* s = std::getenv("SIMT_RACECHECK")) o.racecheck = std::strcmp(s, "0") != 0;
    return o;
  }();
  return opt;
}

std::string environment_error() {
  for (const char* name : {"SIMT_SHUFFLE", "SIMT_RACECHECK", "SIMT_HOST_GUARD"}) {
    const char* v = std::getenv(name);
    if (v && std::strcmp(v, "0") != 0 && std::strcmp(v, "1") != 0)
      return std::string(name) + "='" + v + "' is not allowed (0 turns it off, 1 on)";
  }
  if (const char* v = std::getenv("SIMT_SEED")) {
    errno = 0;
    char* end = nullptr;
    std::strtoull(v, &end, 10);
    if (!*v || *end || *v == '-' || errno == ERANGE)
      return std::string("SIMT_SEED='") + v + "' is not a decimal integer in [0, 2^64)";
  }
  return "";
}

DeviceMemoryModel& device_memory_model() {
  static DeviceMemoryModel model;
  return model;
}

Stats& stats() {
  static Stats s;
  return s;
}

// ----------------------------------------------------------------------------
// fiber stacks: a pool, so a launch of many blocks does not allocate per thread

#if defined(SIMT_ASAN)
static constexpr size_t kStackBytes = 256 * 1024;  // instrumented frames are larger
#else
static constexpr size_t kStackBytes = 64 * 1024;
#endif

struct StackPool {
  std::vector<void*> free_list;
  ~StackPool() {
    for (void* p : free_list) std::free(p);
  }
};
static StackPool& stack_pool() {
  static thread_local StackPool pool;
  return pool;
}

// The base of the stack handed out last: the scheduler records it for ASan's annotations.
static thread_local void* g_last_stack_base = nullptr;

struct PooledStack {  // Boost.Context's StackAllocator concept
  ctx::stack_context allocate() {
    StackPool& pool = stack_pool();
    void* base;
    if (pool.free_list.empty()) {
      base = std::aligned_alloc(64, kStackBytes);
      if (!base) throw std::bad_alloc();
    } else {
      base = pool.free_list.back();
      pool.free_list.pop_back();
    }
    g_last_stack_base = base;
    ctx::stack_context sc;
    sc.size = kStackBytes;
    sc.sp = static_cast<char*>(base) + kStackBytes;  // stacks grow down
    return sc;
  }
  void deallocate(ctx::stack_context& sc) noexcept {
    stack_pool().free_list.push_back(static_cast<char*>(sc.sp) - sc.size);
  }
};

// ----------------------------------------------------------------------------
// threads and the block scheduler

enum class Wait { none, barrier, warp, done };

struct Thread {
  ThreadState state;
  unsigned linear = 0, lane = 0, warp = 0;
  ctx::fiber fiber;  // suspended fiber (scheduler side)
  ctx::fiber sink;   // the scheduler (fiber side)
  Wait wait = Wait::none;
  const char* file = "";
  int line = 0;
  // warp collective in flight
  Shfl kind = Shfl::idx;
  bool is_ballot = false, is_syncwarp = false;
  unsigned mask = 0;
  uint64_t value = 0, result = 0;
  int arg = 0, width = 32;
#if defined(SIMT_ASAN)
  void* fake_stack = nullptr;
  const void* stack_bottom = nullptr;
#endif
};

// Thrown inside a fiber to unwind it when the launch is abandoned after an error.
struct Abandon {};

struct Block {
  const char* kernel = "";
  BlockState state;
  std::vector<Thread> threads;
  Thread* current = nullptr;
  std::vector<unsigned char> dynamic_smem;
  std::exception_ptr error;  // an exception thrown by kernel code
  bool abandoning = false;
#if defined(SIMT_ASAN)
  const void* sched_bottom = nullptr;
  size_t sched_size = 0;
#endif
};

static thread_local Block* g_block = nullptr;

static Block& block() {
  if (!g_block) throw Error("a CUDA built-in (threadIdx, __syncthreads, ...) used outside a kernel launch");
  return *g_block;
}

const ThreadState& current_thread() { return block().current->state; }
const BlockState& current_block() { return block().state; }
void* dynamic_shared_memory() {
  Block& b = block();
  return b.dynamic_smem.empty() ? nullptr : b.dynamic_smem.data();
}

static std::string dim_str(const dim3& d) {
  std::ostringstream os;
  os << "(" << d.x << "," << d.y << "," << d.z << ")";
  return os.str();
}

static std::string where(const Block& b, const Thread& t) {
  return std::string("kernel ") + b.kernel + ", block " + dim_str(b.state.block_idx) +
         ", thread " + dim_str(t.state.thread_idx);
}

static std::string site(const Thread& t) {
  return std::string(t.file) + ":" + std::to_string(t.line);
}

[[noreturn]] static void fail(const Block& b, const Thread& t, const std::string& what) {
  throw Error(where(b, t) + ": " + what);
}

// Fiber side: hand control back to the scheduler until it resumes this thread.
static void yield_to_scheduler(Block& b, Thread& t) {
#if defined(SIMT_ASAN)
  __sanitizer_start_switch_fiber(&t.fake_stack, b.sched_bottom, b.sched_size);
#endif
  t.sink = std::move(t.sink).resume();
#if defined(SIMT_ASAN)
  __sanitizer_finish_switch_fiber(t.fake_stack, &b.sched_bottom, &b.sched_size);
#endif
  if (b.abandoning) throw Abandon{};
}

// Scheduler side: run thread t until it blocks or ends.
static void run_thread(Block& b, Thread& t) {
  b.current = &t;
  stats().switches++;
#if defined(SIMT_ASAN)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, t.stack_bottom, kStackBytes);
#endif
  t.fiber = std::move(t.fiber).resume();
#if defined(SIMT_ASAN)
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  b.current = nullptr;
}

static ctx::fiber make_fiber(Block& b, Thread& t, const std::function<void()>& body) {
  return ctx::fiber(std::allocator_arg, PooledStack(), [&b, &t, &body](ctx::fiber&& sink) {
#if defined(SIMT_ASAN)
    __sanitizer_finish_switch_fiber(nullptr, &b.sched_bottom, &b.sched_size);
#endif
    t.sink = std::move(sink);
    try {
      if (!b.abandoning) body();
    } catch (const Abandon&) {
    } catch (...) {
      if (!b.error) b.error = std::current_exception();
    }
    t.wait = Wait::done;
#if defined(SIMT_ASAN)
    __sanitizer_start_switch_fiber(nullptr, b.sched_bottom, b.sched_size);
#endif
    return std::move(t.sink);
  });
}

// ----------------------------------------------------------------------------
// warp collectives

static bool lane_in(unsigned mask, unsigned lane) { return (mask >> lane) & 1u; }

// Completes the collective of the warp starting at thread w0, if every lane named in the
// masks has reached it; returns whether it did. A lane named in a mask that has exited,
// waits at __syncthreads or at a different collective is an error when `final` (nothing
// else can run any more); before that, a lane that is still running may yet arrive.
static bool resolve_warp(Block& b, size_t w0, bool final) {
  size_t n = b.threads.size(), w1 = std::min(n, w0 + 32);
  bool any = false;
  const Thread* checked = nullptr;  // the last lane whose mask was walked
  for (size_t i = w0; i < w1; i++) {
    Thread& t = b.threads[i];
    if (t.wait != Wait::warp) continue;
    any = true;
    // a lane at the same collective with the same mask as one already walked finds the same
    if (checked && t.mask == checked->mask && t.is_ballot == checked->is_ballot &&
        t.is_syncwarp == checked->is_syncwarp && t.kind == checked->kind)
      continue;
    checked = &t;
    for (unsigned lane = 0; lane < 32; lane++) {
      if (!lane_in(t.mask, lane)) continue;
      if (w0 + lane >= n)
        fail(b, t, "warp collective at " + site(t) + ": mask names lane " + std::to_string(lane) +
                       ", which does not exist in a block of " + std::to_string(n) + " threads");
      Thread& u = b.threads[w0 + lane];
      if (u.wait == Wait::none) return false;  // still running: may yet arrive
      if (u.wait == Wait::done) {
        if (!final) return false;
        fail(b, t, "warp collective at " + site(t) + ": lane " + std::to_string(lane) +
                       " named in the mask has exited");
      }
      if (u.wait == Wait::barrier) {
        if (!final) return false;
        fail(b, t, "warp collective at " + site(t) + ": lane " + std::to_string(lane) +
                       " named in the mask waits at __syncthreads (" + site(u) + ")");
      }
      if (u.mask != t.mask || u.is_ballot != t.is_ballot || u.is_syncwarp != t.is_syncwarp ||
          (!t.is_ballot && !t.is_syncwarp && u.kind != t.kind))
        fail(b, t, "warp collective at " + site(t) + ": lane " + std::to_string(lane) +
                       " is at a different collective or mask (" + site(u) + ")");
    }
  }
  if (!any) return false;
  // All present: compute every waiting lane's result from the deposited values.
  for (size_t i = w0; i < w1; i++) {
    Thread& t = b.threads[i];
    if (t.wait != Wait::warp) continue;
    if (t.is_ballot) {
      uint64_t bits = 0;
      for (unsigned lane = 0; lane < 32; lane++)
        if (lane_in(t.mask, lane) && b.threads[w0 + lane].value) bits |= 1ull << lane;
      t.result = bits;
    } else if (!t.is_syncwarp) {
      int width = t.width, lane = (int)t.lane, base = lane - lane % width, src = lane;
      switch (t.kind) {
        case Shfl::idx: src = base + ((t.arg % width) + width) % width; break;
        case Shfl::bfly: src = lane ^ t.arg; break;
        case Shfl::down: src = lane + t.arg; break;
        case Shfl::up: src = lane - t.arg; break;
      }
      if (src < base || src >= base + width) src = lane;  // outside the segment: own value
      if (!lane_in(t.mask, (unsigned)src))
        fail(b, t, "shuffle at " + site(t) + " reads lane " + std::to_string(src) +
                       ", which is not in the mask");
      t.result = b.threads[w0 + (size_t)src].value;
    }
  }
  for (size_t i = w0; i < w1; i++)
    if (b.threads[i].wait == Wait::warp) b.threads[i].wait = Wait::none;
  stats().warp_collectives++;
  return true;
}

template <typename T>
static uint64_t to_bits(T v) {
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof v);
  return bits;
}
template <typename T>
static T from_bits(uint64_t bits) {
  T v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

static uint64_t warp_collective(const char* file, int line, unsigned mask, uint64_t value,
                                bool is_ballot, bool is_syncwarp, Shfl kind, int arg, int width) {
  Block& b = block();
  Thread& t = *b.current;
  if (!lane_in(mask, t.lane))
    fail(b, t, std::string("warp collective at ") + file + ":" + std::to_string(line) +
                   ": the calling lane " + std::to_string(t.lane) + " is not in its mask");
  if (width < 1 || width > 32 || (width & (width - 1)))
    fail(b, t, "shuffle width " + std::to_string(width) + " is not a power of 2 in [1, 32]");
  t.file = file;
  t.line = line;
  t.mask = mask;
  t.value = value;
  t.is_ballot = is_ballot;
  t.is_syncwarp = is_syncwarp;
  t.kind = kind;
  t.arg = arg;
  t.width = width;
  t.wait = Wait::warp;
  yield_to_scheduler(b, t);
  return t.result;
}

void syncwarp(const char* file, int line, unsigned mask) {
  warp_collective(file, line, mask, 0, false, true, Shfl::idx, 0, 32);
}

unsigned ballot(const char* file, int line, unsigned mask, int predicate) {
  return (unsigned)warp_collective(file, line, mask, predicate != 0, true, false, Shfl::idx, 0, 32);
}

#define SIMT_SHFL(T)                                                                       \
  T shfl(Shfl kind, const char* file, int line, unsigned mask, T v, int arg, int width) { \
    return from_bits<T>(                                                                   \
        warp_collective(file, line, mask, to_bits(v), false, false, kind, arg, width));    \
  }
SIMT_SHFL(float)
SIMT_SHFL(int)
SIMT_SHFL(unsigned)
SIMT_SHFL(long long)
SIMT_SHFL(double)
#undef SIMT_SHFL

void syncthreads(const char* file, int line) {
  Block& b = block();
  Thread& t = *b.current;
  t.file = file;
  t.line = line;
  t.wait = Wait::barrier;
  yield_to_scheduler(b, t);
}

// ----------------------------------------------------------------------------
// launch

static void check_config(const char* kernel, dim3 grid, dim3 blk, size_t smem) {
  auto bad = [&](const std::string& why) {
    throw Error(std::string("kernel ") + kernel + ": invalid launch: " + why + " (grid " +
                dim_str(grid) + ", block " + dim_str(blk) + ")");
  };
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) bad("a grid dimension is 0");
  if (blk.x == 0 || blk.y == 0 || blk.z == 0) bad("a block dimension is 0");
  if ((uint64_t)blk.x * blk.y * blk.z > 1024) bad("more than 1024 threads per block");
  if (blk.z > 64) bad("block z dimension over 64");
  if (grid.y > 65535 || grid.z > 65535) bad("grid y or z dimension over 65535");
  if (smem > options().max_shared_bytes)
    bad(std::to_string(smem) + " bytes of dynamic shared memory, over the limit of " +
        std::to_string(options().max_shared_bytes));
}

static void run_block(Block& b, const std::function<void()>& body, std::mt19937_64& rng) {
  const dim3 bd = b.state.block_dim;
  const size_t n = (size_t)bd.x * bd.y * bd.z;
  b.threads = std::vector<Thread>(n);
  for (size_t i = 0; i < n; i++) {
    Thread& t = b.threads[i];
    t.linear = (unsigned)i;
    t.lane = (unsigned)(i % 32);
    t.warp = (unsigned)(i / 32);
    t.state.thread_idx = dim3((unsigned)(i % bd.x), (unsigned)(i / bd.x % bd.y),
                              (unsigned)(i / ((size_t)bd.x * bd.y)));
  }
  for (Thread& t : b.threads) {
    t.fiber = make_fiber(b, t, body);
#if defined(SIMT_ASAN)
    t.stack_bottom = g_last_stack_base;
#endif
  }
  stats().threads += n;
  // Scheduling unit: the warp, as on a GPU. Pick a warp that has runnable lanes (at random,
  // or the lowest with shuffling off), run those lanes in shuffled order until each blocks
  // at a barrier or a warp collective, or ends; the collective completes when its last lane
  // arrives and the warp is runnable again. So a warp can run ahead of the others — past
  // its shuffles, into the next row of a loop — as far as the barriers allow.
  const size_t warps = (n + 31) / 32;
  std::vector<std::vector<size_t>> ready(warps);  // the runnable lanes of each warp
  auto all_ready = [&] {
    for (size_t i = 0; i < n; i++) ready[i / 32].push_back(i);
  };
  all_ready();
  std::vector<size_t> active, lanes;
  // Half of the blocks (at random) are scheduled "run-ahead": the warp that just ran keeps
  // running with probability 7/8 while it can, so it gets many turns — past its shuffles,
  // through a whole loop iteration — before a slower warp gets one. That is the schedule
  // that exposes a shared buffer reused without a barrier; the uniform one interleaves finely.
  const bool run_ahead = options().shuffle && (rng() & 1);
  size_t last = SIZE_MAX;

  auto abandon = [&]() {  // unwind every suspended fiber, then report
    b.abandoning = true;
    for (Thread& t : b.threads)
      if (t.wait != Wait::done && t.fiber) run_thread(b, t);
  };

  for (;;) {
    for (;;) {
      active.clear();
      for (size_t w = 0; w < warps; w++)
        if (!ready[w].empty()) active.push_back(w);
      if (active.empty()) break;
      size_t w = options().shuffle ? active[(size_t)(rng() % active.size())] : active[0];
      if (run_ahead && last < warps && !ready[last].empty() && rng() % 8 != 0) w = last;
      last = w;
      lanes.swap(ready[w]);
      if (options().shuffle) std::shuffle(lanes.begin(), lanes.end(), rng);
      else std::sort(lanes.begin(), lanes.end());
      for (size_t i : lanes) {
        run_thread(b, b.threads[i]);
        if (b.error) {
          abandon();
          std::rethrow_exception(b.error);
        }
      }
      lanes.clear();
      bool completed;
      try {
        completed = resolve_warp(b, w * 32, /*final=*/false);
      } catch (...) {
        abandon();
        throw;
      }
      if (completed)
        for (size_t i = w * 32; i < std::min(n, w * 32 + 32); i++)
          if (b.threads[i].wait == Wait::none) ready[w].push_back(i);
    }
    size_t done = 0;
    for (const Thread& t : b.threads) done += t.wait == Wait::done;
    if (done == n) return;
    try {
      // Nothing can run: a warp collective still waiting can never complete (error), and
      // every live thread must wait at one barrier. (Collectives complete when their last
      // lane arrives, so resolve_warp finds none to complete here, only errors.)
      for (size_t w0 = 0; w0 < n; w0 += 32) resolve_warp(b, w0, /*final=*/true);
      const Thread* first = nullptr;
      for (const Thread& t : b.threads)
        if (t.wait == Wait::barrier) {
          first = &t;
          break;
        }
      for (const Thread& t : b.threads) {
        if (t.wait == Wait::warp)
          fail(b, t, "warp collective at " + site(t) + " never completes (its mask's lanes wait elsewhere)");
        if (t.wait == Wait::done && first)
          fail(b, *first, "barrier divergence: waits at __syncthreads (" + site(*first) +
                              ") but thread " + dim_str(t.state.thread_idx) + " has exited");
        if (t.wait == Wait::barrier && (t.line != first->line || std::strcmp(t.file, first->file)))
          fail(b, t, "barrier divergence: waits at __syncthreads (" + site(t) + ") while thread " +
                         dim_str(first->state.thread_idx) + " waits at " + site(*first));
      }
    } catch (...) {
      abandon();
      throw;
    }
    for (Thread& t : b.threads) t.wait = Wait::none;  // the barrier opens
    all_ready();
    stats().barriers++;
  }
}

// ----------------------------------------------------------------------------
// pointer arguments: device memory only; nothing written just outside it

static void check_pointers_before(const char* kernel_name, PointerArgs args) {
  const DeviceMemoryModel& m = device_memory_model();
  if (!m.why_not_device_pointer) return;
  for (int i = 0; i < args.count; i++)
    if (const void* p = args.at[i])
      if (const char* why = m.why_not_device_pointer(p)) {
        std::ostringstream os;
        os << "kernel " << kernel_name << ": argument " << i + 1 << " (" << p << ") is " << why
           << ": a kernel can only dereference device memory";
        throw Error(os.str());
      }
}

// Every argument's end first, then the redzones below their starts: two adjacent arguments
// share one redzone, and a write there is the lower one's overrun before the upper one's
// underrun. Each check poisons its redzone again; with `report` false (the launch failed
// anyway) that is all it does, so the next kernel is not blamed for this one's writes.
static void check_pointers_after(const char* kernel_name, PointerArgs args, bool report = true) {
  const DeviceMemoryModel& m = device_memory_model();
  if (!m.out_of_bounds_writes) return;
  for (bool before_start : {false, true})
    for (int i = 0; i < args.count; i++)
      if (const void* p = args.at[i]) {
        std::string what = m.out_of_bounds_writes(p, before_start);
        if (report && !what.empty())
          throw Error(std::string("kernel ") + kernel_name + ": argument " +
                      std::to_string(i + 1) + ": " + what);
      }
}

// Opens device memory (if a model is installed) for the life of a launch.
struct DeviceMemoryScope {
  void (*close)() = device_memory_model().close;  // as at opening: a test may swap models
  DeviceMemoryScope() {
    if (device_memory_model().open) device_memory_model().open();
  }
  ~DeviceMemoryScope() {
    if (close) close();
  }
};

// ----------------------------------------------------------------------------
// the cross-block race check (Options::racecheck)

// Block (x, y, z) of a grid from its linear index x + X (y + Y z).
static dim3 block_of(uint64_t linear, dim3 grid) {
  return dim3((unsigned)(linear % grid.x), (unsigned)(linear / grid.x % grid.y),
              (unsigned)(linear / ((uint64_t)grid.x * grid.y)));
}

// One allocation behind a pointer argument: a copy of it as the last block left it, the block
// that changed each byte (linear index + 1; 0: none yet) and the bytes atomics changed.
struct Watched {
  int arg = 0;
  char* base = nullptr;
  size_t bytes = 0;
  std::vector<char> shadow;
  std::vector<uint32_t> owner;
  std::vector<uint8_t> atomic;
};

static thread_local std::vector<Watched>* g_watched = nullptr;

void detail::note_atomic_slow(const void* p, size_t bytes) {
  if (!g_watched) return;
  const char* c = static_cast<const char*>(p);
  for (Watched& w : *g_watched)
    if (c >= w.base && c + bytes <= w.base + w.bytes)
      std::fill_n(w.atomic.begin() + (c - w.base), bytes, uint8_t(1));
}

struct RaceCheck {
  static constexpr size_t kSpan = 4096;  // compared at once before 64-byte chunks
  std::vector<Watched> watched;
  bool on = false;

  RaceCheck(PointerArgs args, uint64_t blocks) {
    const DeviceMemoryModel& m = device_memory_model();
    if (!options().racecheck || !m.allocation_of || blocks < 2) return;
    uint64_t total = 0;
    for (int i = 0; i < args.count; i++) {
      char* base;
      size_t bytes;
      if (!args.at[i] || !m.allocation_of(args.at[i], &base, &bytes)) continue;
      bool seen = false;
      for (const Watched& w : watched) seen = seen || w.base == base;
      if (seen) continue;  // two arguments into one allocation: watched once
      Watched w;
      w.arg = i;
      w.base = base;
      w.bytes = bytes;
      watched.push_back(std::move(w));
      total += bytes;
    }
    if (watched.empty()) return;
    const uint64_t budget = options().racecheck_budget_bytes;
    if (total > budget / 4 || total > budget / blocks || blocks >= UINT32_MAX) {
      stats().racecheck_skipped++;
      watched.clear();
      return;
    }
    stats().racecheck_launches++;
    for (Watched& w : watched) {
      w.shadow.assign(w.base, w.base + w.bytes);
      w.owner.assign(w.bytes, 0);
      w.atomic.assign(w.bytes, 0);
    }
    on = true;
    g_watched = &watched;
    detail::racecheck_running = true;
  }
  ~RaceCheck() {
    if (!on) return;
    g_watched = nullptr;
    detail::racecheck_running = false;
  }

  // After block `linear` ran: the bytes it changed are its own, unless another block changed
  // them before (without atomics).
  void after_block(const char* kernel, uint64_t linear, dim3 grid) {
    if (!on) return;
    const uint32_t me = (uint32_t)linear + 1;
    for (Watched& w : watched) {
      for (size_t chunk = 0; chunk < w.bytes; chunk += 64) {
        // a block writes a small part of an argument: skip whole unchanged pages at once
        if (chunk % kSpan == 0) {
          const size_t span = std::min<size_t>(kSpan, w.bytes - chunk);
          if (std::memcmp(w.base + chunk, w.shadow.data() + chunk, span) == 0) {
            chunk += span - 64;
            continue;
          }
        }
        const size_t n = std::min<size_t>(64, w.bytes - chunk);
        if (std::memcmp(w.base + chunk, w.shadow.data() + chunk, n) == 0) continue;
        for (size_t i = chunk; i < chunk + n; i++) {
          if (w.base[i] == w.shadow[i]) continue;
          w.shadow[i] = w.base[i];
          if (w.atomic[i]) continue;
          if (w.owner[i] != 0 && w.owner[i] != me)
            throw Error(std::string("kernel ") + kernel + ": race: blocks " +
                        dim_str(block_of(w.owner[i] - 1, grid)) + " and " +
                        dim_str(block_of(linear, grid)) + " both wrote argument " +
                        std::to_string(w.arg + 1) + " at byte offset " + std::to_string(i) +
                        " of its allocation, without an atomic: on a GPU they run at the same "
                        "time and one write is lost");
          w.owner[i] = me;
        }
      }
    }
  }
};

// The order blocks run in: i -> (stride * i + offset) mod n, a permutation of 0..n-1 when
// gcd(stride, n) = 1. A random stride and offset per launch shuffle the order without a
// table the size of the grid.
struct BlockOrder {
  uint64_t n, stride = 1, offset = 0;
  BlockOrder(uint64_t n_, bool shuffle, std::mt19937_64& rng) : n(n_) {
    if (!shuffle || n < 2) return;
    offset = rng() % n;
    do stride = 1 + rng() % (n - 1);
    while (std::gcd(stride, n) != 1);
  }
  uint64_t operator[](uint64_t i) const {
    return (uint64_t)(((unsigned __int128)stride * i + offset) % n);
  }
};

static void run_grid(const char* kernel_name, dim3 grid, dim3 blk, size_t dynamic_smem_bytes,
                     const std::function<void()>& body, PointerArgs pointers) {
  static uint64_t launches = 0;
  std::mt19937_64 rng(options().seed * 0x9E3779B97F4A7C15ull + launches++);
  Block b;
  b.kernel = kernel_name;
  b.state.block_dim = blk;
  b.state.grid_dim = grid;
  b.dynamic_smem.resize(dynamic_smem_bytes);
  const uint64_t blocks = (uint64_t)grid.x * grid.y * grid.z;
  const BlockOrder order(blocks, options().shuffle, rng);
  RaceCheck race(pointers, blocks);
  g_block = &b;
  try {
    for (uint64_t i = 0; i < blocks; i++) {
      const uint64_t linear = order[i];
      b.state.block_idx = block_of(linear, grid);
      std::fill(b.dynamic_smem.begin(), b.dynamic_smem.end(), (unsigned char)0xFF);
      b.error = nullptr;
      b.abandoning = false;
      run_block(b, body, rng);
      stats().blocks++;
      race.after_block(kernel_name, linear, grid);
    }
  } catch (...) {
    g_block = nullptr;
    throw;
  }
  g_block = nullptr;
}

void launch(const char* kernel_name, dim3 grid, dim3 blk, size_t dynamic_smem_bytes,
            const std::function<void()>& body, PointerArgs pointers) {
  check_config(kernel_name, grid, blk, dynamic_smem_bytes);
  if (g_block) throw Error(std::string("kernel ") + kernel_name + ": launched from inside a kernel");
  check_pointers_before(kernel_name, pointers);
  DeviceMemoryScope open;  // the kernel, and the checks after it, may touch device memory
  try {
    run_grid(kernel_name, grid, blk, dynamic_smem_bytes, body, pointers);
  } catch (...) {
    check_pointers_after(kernel_name, pointers, /*report=*/false);
    throw;
  }
  check_pointers_after(kernel_name, pointers);
}

}  // namespace simt
