// kernels/sim_memory.h — the memory of device "sim": a separate address space, as on a GPU.
//
// On a GPU, cudaMalloc'd memory is not the host's: host code that dereferences a device
// pointer crashes, a kernel handed a host pointer faults, and fresh device memory holds
// whatever was there before. The sim device runs its kernels on the CPU, where every
// pointer would work, so it models that separation to make those bugs show up without a GPU:
//
//   * Its allocations live in one reserved region of the address space that is closed
//     (PROT_NONE) except while a kernel runs or a device copy or memset is in progress.
//     Host code that reads or writes it gets one `error:` line naming the address, then
//     exit 1 — the run fails here, as it would on a GPU, instead of quietly succeeding.
//   * Every pointer argument of a kernel launch must point into a live allocation (or be
//     null): a host pointer, or memory already freed, is a simt::Error naming the kernel.
//   * New allocations are filled with 0xFF bytes (NaN as float32, -1 as int64), so a kernel
//     that reads memory nobody wrote produces NaN instead of a lucky zero.
//   * Every allocation is followed by at least 64 poisoned bytes (a redzone). After each
//     launch, the redzone after each pointer argument's allocation, and that of the live
//     allocation directly below it, must still be poison: a kernel that writes one past the
//     end (or before the start) is a simt::Error naming the kernel and argument — the
//     out-of-bounds write that compute-sanitizer's memcheck reports on a GPU. A write far
//     out of bounds lands in another allocation (unseen) or in the unused part of the
//     region (an error line, as for the host).
//
// SIMT_HOST_GUARD=0 leaves the region open to the host (to look at device memory in a
// debugger); the argument check and the poison stay.
#pragma once
#include <cstddef>
#include <string>

namespace ff::sim_memory {

// Page-granular, 4 KiB aligned; throws std::runtime_error when the region is exhausted.
void* allocate(size_t bytes);
void release(void* p);

// Host access for the duration of a scope: device copies, memsets, kernel launches.
// Scopes nest.
struct HostAccess {
  HostAccess();
  ~HostAccess();
  HostAccess(const HostAccess&) = delete;
  HostAccess& operator=(const HostAccess&) = delete;
};

// nullptr if `p` lies in the pages of a live allocation (its redzone included, so a pointer
// to the end is fine), else why it may not be given to a kernel.
const char* why_not_device_pointer(const void* p);

// Makes sure the sim device's memory model is in force (kernels_for(Device::sim) calls it),
// so that kernel launches are checked even before the first sim allocation.
void install();

// The live allocation holding `p`: its first byte and the bytes asked for. False if none.
bool allocation_of(const void* p, char** base, size_t* bytes);

// "" if the redzone after the allocation holding `p` (with before_start: the redzone of the
// live allocation directly below it) is intact, else what was written there; the redzone is
// poison again afterwards. Called after every launch for each pointer argument, ends first;
// the region must be open.
std::string out_of_bounds_writes(const void* p, bool before_start);

// What the region holds: bytes of the live allocations (whole pages, redzones included), and
// the extent of the part handed out so far (freed blocks at its top are given back, so it
// shrinks again).
struct Usage {
  size_t live_bytes = 0, top_bytes = 0;
};
Usage usage();

// The poison byte of fresh allocations.
constexpr unsigned char kPoison = 0xFF;

}  // namespace ff::sim_memory
