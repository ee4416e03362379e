// kernels/simt_emulator.h — runs CUDA kernels on the CPU (see kernels/simt.h).
//
// Model: the blocks of a grid run one after another, in a shuffled order (a GPU promises
// none, so a kernel that counts on block 0 finishing before block 1 fails here too). The
// threads of a block are fibers (Boost.Context) on one OS thread. A fiber runs until it
// reaches a barrier (__syncthreads), a warp collective (__shfl*_sync, __ballot_sync,
// __syncwarp) or its end; then another one runs. The scheduler picks a warp at random
// (seeded) and runs its runnable threads in shuffled order; a warp collective completes as
// soon as its last lane arrives, so a warp may run ahead of the others up to the next barrier
// (and in half of the blocks, picked at random, the warp that just ran is favoured, so it
// often does). A kernel that forgets a __syncthreads therefore reads memory other threads
// have not written yet (or have already overwritten) and gets a wrong result — as on a GPU,
// where the order is unspecified too. With shuffling off, blocks, warps and threads run in
// index order. Each block's dynamic shared memory starts as 0xFF bytes (NaN as float32):
// uninitialised, as on a GPU, rather than a helpful zero. Running blocks one at a time hides
// two blocks writing one element without an atomic; the race check (Options::racecheck)
// finds that instead.
//
// Misuse is an error, never a hang: barrier divergence (threads waiting at different
// barriers, or some waiting while others have exited), a warp collective whose mask names
// threads that do not take part, a block of more than 1024 threads, dynamic shared memory
// over the limit (48 KiB by default). launch() throws simt::Error with a one-line message
// naming the kernel, the block and the thread.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace simt {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1)
      : x(x_), y(y_), z(z_) {}
};

struct ThreadState {
  dim3 thread_idx;
};
struct BlockState {
  dim3 block_idx, block_dim, grid_dim;
};

// The running thread and its block (what threadIdx, blockIdx ... read).
const ThreadState& current_thread();
const BlockState& current_block();
void* dynamic_shared_memory();

// ---- device memory
// On a GPU a kernel dereferences device memory only, and the host cannot dereference it. A
// device-memory model (the sim device's: kernels/sim_memory.h) installs these hooks; then
// every launch checks its pointer arguments, opens device memory for its duration, and
// afterwards checks that the kernel wrote nothing just outside its arguments' allocations.
// Unset, as in the emulator's own tests, a kernel may take any pointer.
struct DeviceMemoryModel {
  const char* (*why_not_device_pointer)(const void* p) = nullptr;  // nullptr: fine
  void (*open)() = nullptr;   // the host (running the kernel) may now touch device memory
  void (*close)() = nullptr;  // ... and now no more
  // After the launch: "" if the redzone after p's allocation (or, with before_start, the
  // one just below it) is intact, else what was written out of bounds (memcheck's job on a
  // GPU). Either way the redzone is poison again afterwards.
  std::string (*out_of_bounds_writes)(const void* p, bool before_start) = nullptr;
  // The allocation holding p (for the race check): its first byte and its size.
  bool (*allocation_of)(const void* p, char** base, size_t* bytes) = nullptr;
};

// The pointer arguments of a launch by position (nullptr where an argument is not a pointer).
struct PointerArgs {
  const void* const* at = nullptr;
  int count = 0;
};

// Runs body() once per thread of every block of the grid. With a device-memory model
// installed, it first checks the pointer arguments (device memory only), opens device memory
// for the launch, and afterwards checks for writes just outside their allocations (and, with
// racecheck on, for two blocks writing one byte); each failed check throws simt::Error.
void launch(const char* kernel_name, dim3 grid, dim3 block, size_t dynamic_smem_bytes,
            const std::function<void()>& body, PointerArgs pointers = {});

template <typename T>
const void* pointer_or_null(const T& arg) {
  if constexpr (std::is_pointer_v<T>) return static_cast<const void*>(arg);
  else return nullptr;
}

// SIMT_LAUNCH: the arguments are evaluated once, on the host, as in a real launch; every
// thread then calls kernel(args...) with the same values.
template <typename Kernel, typename... Args>
void launch_kernel(const char* kernel_name, dim3 grid, dim3 block, size_t dynamic_smem_bytes,
                   Kernel kernel, Args... args) {
  const void* pointers[sizeof...(Args) + 1] = {pointer_or_null(args)...};
  launch(kernel_name, grid, block, dynamic_smem_bytes, [&] { kernel(args...); },
         {pointers, (int)sizeof...(Args)});
}

// ---- what the built-ins call
void syncthreads(const char* file, int line);
void syncwarp(const char* file, int line, unsigned mask = 0xffffffffu);
enum class Shfl { idx, bfly, down, up };
// The value of `v` held by the source lane (idx: lane; bfly: lane ^ arg; down: lane + arg;
// up: lane - arg; out of the segment of `width` lanes: the caller's own value).
float shfl(Shfl kind, const char* file, int line, unsigned mask, float v, int arg, int width = 32);
int shfl(Shfl kind, const char* file, int line, unsigned mask, int v, int arg, int width = 32);
unsigned shfl(Shfl kind, const char* file, int line, unsigned mask, unsigned v, int arg,
              int width = 32);
long long shfl(Shfl kind, const char* file, int line, unsigned mask, long long v, int arg,
               int width = 32);
double shfl(Shfl kind, const char* file, int line, unsigned mask, double v, int arg,
            int width = 32);
unsigned ballot(const char* file, int line, unsigned mask, int predicate);

// ---- schedule and limits
struct Options {
  bool shuffle = true;          // random thread order between barriers, random block order
  uint64_t seed = 0x5eed;       // of the shuffle
  size_t max_shared_bytes = 48 * 1024;  // dynamic shared memory per block
  // The cross-block race check. Blocks run one after another here, so two blocks that write
  // the same element without an atomic both "work"; on a GPU they run at the same time and
  // one write is lost. With racecheck on, a launch records which block changed each byte of
  // its pointer arguments' allocations (a device-memory model says where they are) and
  // reports a byte changed by two blocks, unless atomics changed it (a block that writes
  // the value already there changes nothing, and is not seen). It compares the allocations
  // after every block and keeps a copy of them, so a launch whose blocks x bytes exceed the
  // budget, or whose arguments exceed 1/4 of it, is skipped (and counted in stats()).
  bool racecheck = true;
  uint64_t racecheck_budget_bytes = uint64_t(64) << 20;
};
// Defaults come from the environment: SIMT_SHUFFLE=0 turns shuffling off, SIMT_SEED=N,
// SIMT_RACECHECK=0 turns the race check off.
// The SIMT_* environment variables, checked: "" when every one that is set has an allowed value
// (SIMT_SHUFFLE, SIMT_RACECHECK, SIMT_HOST_GUARD: 0 or 1; SIMT_SEED: a decimal integer), else
// one sentence naming the variable, its value and what is allowed. A typo must not silently
// mean the default: programs call this before any work.
std::string environment_error();
Options& options();
// The device-memory model in force (none by default; the sim device installs its own).
// Kept apart from options(), so that code saving and restoring options leaves it alone.
DeviceMemoryModel& device_memory_model();

// Counters, for tests and `make bench`.
struct Stats {
  uint64_t blocks = 0, threads = 0, barriers = 0, warp_collectives = 0, switches = 0;
  uint64_t racecheck_launches = 0, racecheck_skipped = 0;
};
Stats& stats();

// Atomics call this (kernels/simt.h): the race check lets several blocks change a byte that
// atomics change.
namespace detail {
inline thread_local bool racecheck_running = false;
void note_atomic_slow(const void* p, size_t bytes);
}  // namespace detail
inline void note_atomic(const void* p, size_t bytes) {
  if (detail::racecheck_running) detail::note_atomic_slow(p, bytes);
}

}  // namespace simt
