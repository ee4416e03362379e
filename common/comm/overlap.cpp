// common/comm/overlap.cpp — see overlap.h.
#include "common/comm/overlap.h"

#include <boost/context/fiber.hpp>
#include <boost/context/protected_fixedsize_stack.hpp>

#include <exception>
#include <string>
#include <utility>

#include "common/core/autograd.h"
#include "common/core/check.h"
#include "common/util/trace.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define FF_OVERLAP_ASAN 1
#endif

namespace ff::overlap {

namespace ctx = boost::context;

namespace {

// A half's stack: the forward of a stage runs the layers (and under --device sim the SIMT
// emulator's scheduler) on it; a guard page turns an overflow into a crash, not corruption.
constexpr size_t kStackBytes = 8u << 20;

struct Half {
  ctx::fiber fiber;       // suspended half (scheduler side)
  ctx::fiber sink;        // the scheduler (half side)
  bool done = false;
  bool grad = true;       // its autograd mode while suspended
  std::string category;   // its trace category while suspended
  std::exception_ptr error;
  std::function<void()> poll;  // while suspended in an all-to-all: one test of its messages
  void* stack_bottom = nullptr;
  size_t stack_size = 0;
#if defined(FF_OVERLAP_ASAN)
  void* fake_stack = nullptr;
#endif
};

struct Pair {
  Half half[2];
  int current = -1;  // the half running now
  const void* sched_bottom = nullptr;
  size_t sched_size = 0;
};

thread_local Pair* g_pair = nullptr;
thread_local long g_switches = 0;

// Scheduler side: run half h until it yields or ends, in its own autograd mode and category.
void resume(Pair& p, int h) {
  Half& x = p.half[h];
  set_grad_enabled(x.grad);
  trace().set_category(x.category);
  // between its ops, the running half polls the suspended one's messages
  Half& other = p.half[1 - h];
  set_between_ops(other.done || !other.poll ? std::function<void()>() : other.poll);
  p.current = h;
#if defined(FF_OVERLAP_ASAN)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, x.stack_bottom, x.stack_size);
#endif
  x.fiber = std::move(x.fiber).resume();
#if defined(FF_OVERLAP_ASAN)
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  p.current = -1;
  x.grad = grad_enabled();
  x.category = trace().category();
}

// Boost.Context's protected stack (a guard page below it), noting where it is for ASan.
struct NotedStack {
  ctx::protected_fixedsize_stack inner{kStackBytes};
  Half* half;
  ctx::stack_context allocate() {
    ctx::stack_context sc = inner.allocate();
    half->stack_bottom = static_cast<char*>(sc.sp) - sc.size;
    half->stack_size = sc.size;
    return sc;
  }
  void deallocate(ctx::stack_context& sc) noexcept { inner.deallocate(sc); }
};

ctx::fiber make_half(Pair& p, int h, const std::function<void()>& body) {
  return ctx::fiber(std::allocator_arg, NotedStack{{}, &p.half[h]}, [&p, h, &body](ctx::fiber&& sink) {
    Half& x = p.half[h];
#if defined(FF_OVERLAP_ASAN)
    __sanitizer_finish_switch_fiber(nullptr, &p.sched_bottom, &p.sched_size);
#endif
    x.sink = std::move(sink);
    try {
      body();
    } catch (...) {
      x.error = std::current_exception();
    }
    x.done = true;
#if defined(FF_OVERLAP_ASAN)
    __sanitizer_start_switch_fiber(nullptr, p.sched_bottom, p.sched_size);
#endif
    return std::move(x.sink);
  });
}

}  // namespace

void run_step(const std::function<void()>& forward, const std::function<void()>& backward) {
  FF_CHECK(g_pair == nullptr, "overlap::run_step inside a pair");
  Pair p;
  const bool grad = grad_enabled();
  const std::string category = trace().category();
  p.half[0].grad = p.half[1].grad = grad;
  p.half[0].category = category;
  p.half[1].category = "paired backward";
  for (int h = 0; h < 2; h++) p.half[h].fiber = make_half(p, h, h == 0 ? forward : backward);
  g_pair = &p;
  // the pass kStepOrder[0] runs until its first all-to-all, then they alternate at each one
  int h = kStepOrder[0] == Pass::forward ? 0 : 1;
  while (!p.half[0].done || !p.half[1].done) {
    if (p.half[h].done) h = 1 - h;
    resume(p, h);
    if (!p.half[1 - h].done) h = 1 - h;
  }
  g_pair = nullptr;
  set_between_ops({});
  set_grad_enabled(grad);
  trace().set_category(category);
  for (const Half& x : p.half)
    if (x.error) std::rethrow_exception(x.error);
}

void yield(const std::function<void()>& poll) {
  Pair* p = g_pair;
  if (!p || p->current < 0 || p->half[1 - p->current].done) return;
  Half& x = p->half[p->current];
  g_switches++;
  x.poll = poll;
#if defined(FF_OVERLAP_ASAN)
  __sanitizer_start_switch_fiber(&x.fake_stack, p->sched_bottom, p->sched_size);
#endif
  x.sink = std::move(x.sink).resume();
#if defined(FF_OVERLAP_ASAN)
  __sanitizer_finish_switch_fiber(x.fake_stack, &p->sched_bottom, &p->sched_size);
#endif
  x.poll = nullptr;
}

long switches() { return g_switches; }

}  // namespace ff::overlap
