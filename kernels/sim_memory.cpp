// kernels/sim_memory.cpp — device "sim"'s memory: one reserved region, closed to the host
// outside kernels and device copies (see kernels/sim_memory.h).
//
// The region is reserved once (mmap, PROT_NONE, no swap reserved) and handed out in whole
// pages by a best-fit allocator that merges free neighbours. Opening and closing it is one
// mprotect of the part in use (allocating and freeing protect just their block); a fault
// inside it is reported by a SIGSEGV handler that passes every other fault on to whoever
// handled SIGSEGV before.
#include "kernels/sim_memory.h"

#include <execinfo.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <iterator>
#include <string>

#include "kernels/simt_emulator.h"

namespace ff::sim_memory {

namespace {

// The system's page size (4 KiB on x86-64; 16 or 64 KiB on some aarch64 kernels).
const size_t kPage = (size_t)::sysconf(_SC_PAGESIZE);
// At least this many poisoned bytes follow every allocation: a kernel that writes there (one
// past the end, say) is reported after its launch.
constexpr size_t kRedzone = 64;

struct Region {
  char* base = nullptr;
  size_t reserved = 0;    // bytes of address space
  size_t used = 0;        // [base, base + used) has been handed out at some point
  int open_depth = 0;     // HostAccess scopes (and kernel launches) in progress
  bool guard = true;      // SIMT_HOST_GUARD != 0: closed outside them
  struct Live {
    size_t size;       // whole pages
    size_t requested;  // what the caller asked for; the rest is a poisoned redzone
  };
  std::map<char*, Live> live;
  std::map<char*, size_t> free_by_addr;   // free block -> bytes
  std::multimap<size_t, char*> free_by_size;
  std::mutex mu;
};

Region& region();

// The live allocation whose pages hold p (its redzone included), or live.end(). Under r.mu.
std::map<char*, Region::Live>::iterator live_block_at(Region& r, const void* ptr) {
  char* p = static_cast<char*>(const_cast<void*>(ptr));
  auto it = r.live.upper_bound(p);
  if (it == r.live.begin()) return r.live.end();
  --it;
  return p < it->first + it->second.size ? it : r.live.end();
}

// ---- the fault handler

struct sigaction g_previous;  // SIGSEGV's handler before ours, for faults outside the region
char* g_base = nullptr;       // read by the handler: the region, fixed once reserved
size_t g_reserved = 0;
volatile sig_atomic_t g_open = 0;  // read by the handler: a kernel or a device copy is running

void write_str(const char* s) {
  ssize_t n = ::write(STDERR_FILENO, s, std::strlen(s));
  (void)n;
}

// Async-signal-safe: writes and _exit only (snprintf of integers does not allocate in glibc).
void on_segv(int sig, siginfo_t* info, void* ucontext) {
  char* addr = static_cast<char*>(info->si_addr);
  if (g_base && addr >= g_base && addr < g_base + g_reserved) {
    char line[512];
    if (g_open)  // open: everything allocated is reachable, so this is beyond every allocation
      std::snprintf(line, sizeof line,
                    "error: a kernel or device copy on 'sim' touched device memory at %p, outside "
                    "every allocation (an index far out of bounds?)\n",
                    (void*)addr);
    else
      std::snprintf(line, sizeof line,
                    "error: host code touched device memory of 'sim' at %p, outside a kernel or a "
                    "device copy: on a GPU the host cannot dereference a device pointer (copy it "
                    "with Tensor::to(Device::cpu) or to_vector() first; SIMT_HOST_GUARD=0 turns "
                    "this check off)\n",
                    (void*)addr);
    write_str(line);
    write_str("  the access, innermost frame first (addr2line -f -C -e BINARY +OFFSET names the line):\n");
    void* frames[32];
    int n = ::backtrace(frames, 32);
    ::backtrace_symbols_fd(frames + 2, n > 2 ? n - 2 : 0, STDERR_FILENO);  // skip the handler
    ::_exit(1);
  }
  // Not ours: hand the fault to the previous handler (Open MPI's, a sanitizer's, the default).
  if (g_previous.sa_flags & SA_SIGINFO) {
    g_previous.sa_sigaction(sig, info, ucontext);
  } else if (g_previous.sa_handler == SIG_DFL || g_previous.sa_handler == SIG_IGN) {
    ::signal(SIGSEGV, SIG_DFL);  // returning re-runs the access, which now kills the process
  } else {
    g_previous.sa_handler(sig);
  }
}

void install_handler() {
  void* warm[1];
  ::backtrace(warm, 1);  // loads libgcc's unwinder now, not inside the handler
  struct sigaction sa;
  std::memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_segv;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGSEGV, &sa, &g_previous);
}

// ---- open and close

void protect(Region& r, char* p, size_t bytes, bool open) {
  if (bytes == 0 || !r.guard) return;  // unguarded: mapped read-write once
  if (::mprotect(p, bytes, open ? PROT_READ | PROT_WRITE : PROT_NONE) != 0)
    throw std::runtime_error(std::string("sim device memory: mprotect failed: ") + std::strerror(errno));
}

void open_region() {
  Region& r = region();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.open_depth++ == 0) {
    protect(r, r.base, r.used, true);
    g_open = 1;
  }
}
void close_region() {
  Region& r = region();
  std::lock_guard<std::mutex> lock(r.mu);
  if (--r.open_depth == 0) {
    g_open = 0;
    protect(r, r.base, r.used, false);
  }
}

Region& region() {
  static Region* r = [] {
    auto* reg = new Region;  // never destroyed: tensors may be freed during static destruction
    if (const char* s = std::getenv("SIMT_HOST_GUARD")) reg->guard = std::strcmp(s, "0") != 0;
    // As much address space as the machine lets us reserve, from 64 GiB down.
    for (size_t bytes = size_t(64) << 30; bytes >= (size_t(256) << 20); bytes /= 2) {
      void* p = ::mmap(nullptr, bytes, reg->guard ? PROT_NONE : PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p != MAP_FAILED) {
        reg->base = static_cast<char*>(p);
        reg->reserved = bytes;
        break;
      }
    }
    if (!reg->base) throw std::runtime_error("sim device memory: cannot reserve address space");
    g_base = reg->base;
    g_reserved = reg->reserved;
    if (reg->guard) install_handler();
    // The emulator's side: a launch opens the region and checks its pointer arguments.
    simt::device_memory_model() = {why_not_device_pointer, open_region, close_region,
                                   out_of_bounds_writes, allocation_of};
    return reg;
  }();
  return *r;
}

// ---- the free list: best fit, neighbours merged

void take_free(Region& r, std::map<char*, size_t>::iterator it) {
  auto range = r.free_by_size.equal_range(it->second);
  for (auto s = range.first; s != range.second; ++s)
    if (s->second == it->first) {
      r.free_by_size.erase(s);
      break;
    }
  r.free_by_addr.erase(it);
}

void add_free(Region& r, char* p, size_t bytes) {
  auto next = r.free_by_addr.lower_bound(p);
  if (next != r.free_by_addr.end() && p + bytes == next->first) {
    bytes += next->second;
    take_free(r, next);
  }
  auto prev = r.free_by_addr.lower_bound(p);
  if (prev != r.free_by_addr.begin()) {
    --prev;
    if (prev->first + prev->second == p) {
      p = prev->first;
      bytes += prev->second;
      take_free(r, prev);
    }
  }
  if (p + bytes == r.base + r.used) {  // the top of the used part: give it back
    r.used -= bytes;
    if (r.open_depth > 0) protect(r, p, bytes, false);  // closing will not reach it any more
    return;
  }
  r.free_by_addr[p] = bytes;
  r.free_by_size.emplace(bytes, p);
}

}  // namespace

void* allocate(size_t bytes) {
  Region& r = region();
  std::lock_guard<std::mutex> lock(r.mu);
  if (bytes > r.reserved)
    throw std::runtime_error("out of sim device memory allocating " + std::to_string(bytes) +
                             " bytes (" + std::to_string(r.reserved >> 20) + " MiB reserved)");
  const size_t size = (bytes + kRedzone + kPage - 1) / kPage * kPage;
  char* p = nullptr;
  auto fit = r.free_by_size.lower_bound(size);
  if (fit != r.free_by_size.end()) {
    p = fit->second;
    size_t have = fit->first;
    take_free(r, r.free_by_addr.find(p));
    if (have > size) {
      r.free_by_addr[p + size] = have - size;
      r.free_by_size.emplace(have - size, p + size);
    }
  } else {
    if (size > r.reserved - r.used)
      throw std::runtime_error("out of sim device memory allocating " + std::to_string(bytes) +
                               " bytes (" + std::to_string(r.reserved >> 20) + " MiB reserved, " +
                               std::to_string(r.used >> 20) + " MiB in use)");
    p = r.base + r.used;
    r.used += size;
  }
  r.live[p] = {size, bytes};
  // Poison: fresh device memory holds garbage on a GPU; here it holds NaN / -1.
  protect(r, p, size, true);
  std::memset(p, kPoison, size);
  if (r.open_depth == 0) protect(r, p, size, false);
  return p;
}

void release(void* ptr) {
  if (!ptr) return;
  Region& r = region();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.live.find(static_cast<char*>(ptr));
  if (it == r.live.end()) throw std::runtime_error("sim device memory: freeing a pointer it did not allocate");
  char* p = it->first;
  size_t size = it->second.size;
  r.live.erase(it);
  // Large blocks give their pages back to the system (they read as zero until poisoned again).
  if (size >= (size_t(1) << 20)) ::madvise(p, size, MADV_DONTNEED);
  add_free(r, p, size);
}

Usage usage() {
  Region& r = region();
  std::lock_guard<std::mutex> lock(r.mu);
  Usage u;
  for (const auto& [p, block] : r.live) u.live_bytes += block.size;
  u.top_bytes = r.used;
  return u;
}

void install() { region(); }

HostAccess::HostAccess() { open_region(); }
HostAccess::~HostAccess() { close_region(); }

const char* why_not_device_pointer(const void* ptr) {
  Region& r = region();
  const char* p = static_cast<const char*>(ptr);
  if (p < r.base || p >= r.base + r.reserved) return "a host pointer, not device memory";
  std::lock_guard<std::mutex> lock(r.mu);
  if (live_block_at(r, p) == r.live.end()) return "device memory that is not allocated (freed already?)";
  return nullptr;
}

bool allocation_of(const void* ptr, char** base, size_t* bytes) {
  Region& r = region();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = live_block_at(r, ptr);
  if (it == r.live.end() || static_cast<const char*>(ptr) >= it->first + it->second.requested)
    return false;
  *base = it->first;
  *bytes = it->second.requested;
  return true;
}

// The first byte of [p, p + n) that is no longer poison, or n.
static size_t first_written(const char* p, size_t n) {
  for (size_t i = 0; i < n; i++)
    if ((unsigned char)p[i] != kPoison) return i;
  return n;
}

// Reports the first out-of-bounds byte and poisons the redzone again, so one bad write is
// one report.
std::string out_of_bounds_writes(const void* ptr, bool before_start) {
  Region& r = region();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = live_block_at(r, ptr);
  if (it == r.live.end()) return "";
  char* p = it->first;
  const Region::Live& block = it->second;
  const size_t tail = block.size - block.requested;
  const size_t i = before_start ? tail : first_written(p + block.requested, tail);
  if (i < tail) {
    std::memset(p + block.requested, kPoison, tail);
    return "wrote past the end of its " + std::to_string(block.requested) +
           "-byte device allocation (at byte offset " + std::to_string(block.requested + i) + ")";
  }
  // The redzone of the allocation just below ends where this one starts.
  if (before_start && it != r.live.begin()) {
    auto below = std::prev(it);
    const Region::Live& b = below->second;
    const size_t n = b.size - b.requested;
    if (below->first + b.size == p) {
      const size_t j = first_written(below->first + b.requested, n);
      if (j < n) {
        std::memset(below->first + b.requested, kPoison, n);
        return "wrote before the start of its " + std::to_string(block.requested) +
               "-byte device allocation (at byte offset -" + std::to_string(n - j) + ")";
      }
    }
  }
  return "";
}

}  // namespace ff::sim_memory
