// common/comm/overlap.h under mpirun: a forward and a backward run as a pair take turns at
// their all-to-alls, give the sequential results bit for bit, keep their own autograd mode
// and trace track, and pass an error on. Any world size 1..4.
#include <doctest/doctest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "common/comm/alltoall.h"
#include "common/comm/comm.h"
#include "common/comm/overlap.h"
#include "common/core/autograd.h"
#include "common/core/ops.h"
#include "common/core/tensor.h"
#include "common/util/trace.h"

using namespace ff;

namespace {

Comm overlap_comm() {
  Comm c = Comm::world(nullptr, nullptr);
  c.set_timeout(30);
  return c;
}

// One "layer" of a half: an all-to-all of `rows` floats to every rank (a2a_async, where a
// pair hands over), then some arithmetic on what arrived; `log` records the order of events.
std::vector<float> layer(Comm& c, const std::vector<float>& in, int tag, std::vector<std::string>* log,
                         const std::string& who) {
  const size_t P = (size_t)c.size(), rows = in.size() / P;
  std::vector<size_t> bytes(P, rows * sizeof(float));
  std::vector<float> out(in.size());
  if (log) log->push_back(who + " start");
  a2a_async(c, reinterpret_cast<const char*>(in.data()), bytes, reinterpret_cast<char*>(out.data()),
            bytes, tag);
  if (log) log->push_back(who + " finish");
  for (size_t i = 0; i < out.size(); i++) out[i] = out[i] * 1.0001f + 0.5f * (float)i;
  return out;
}

std::vector<float> run_half(Comm& c, int seed, int layers, int tag, std::vector<std::string>* log,
                            const std::string& who) {
  std::vector<float> x((size_t)c.size() * 3);
  for (size_t i = 0; i < x.size(); i++) x[i] = 0.25f * (float)(seed + 7 * c.rank()) + 0.125f * (float)i;
  for (int l = 0; l < layers; l++) x = layer(c, x, tag, log, who);
  return x;
}

}  // namespace

TEST_CASE("overlap: a pair takes turns at each all-to-all and equals the two run one after the other") {
  Comm c = overlap_comm();
  // the tags keep the two halves' messages apart, as lesson 08's layers' do
  const std::vector<float> f_seq = run_half(c, 1, 3, 11, nullptr, "F");
  const std::vector<float> b_seq = run_half(c, 2, 2, 12, nullptr, "B");
  std::vector<float> f, b;
  std::vector<std::string> log;
  const long before = overlap::switches();
  overlap::run_step([&] { f = run_half(c, 1, 3, 11, &log, "F"); },
                    [&] { b = run_half(c, 2, 2, 12, &log, "B"); });
  CHECK(f == f_seq);
  CHECK(b == b_seq);
  // DeepSeek-V3's order (overlap::kStepOrder): B starts its first all-to-all, F runs until it
  // starts its own, B finishes, and so on; once B has ended F runs on alone
  REQUIRE(overlap::kStepOrder[0] == overlap::Pass::backward);
  const std::vector<std::string> want = {"B start", "F start", "B finish", "B start", "F finish",
                                         "F start", "B finish", "F finish", "F start", "F finish"};
  CHECK(log == want);
  // every start hands over while the other half has not ended: B, F, B, F (F's third alone)
  CHECK(overlap::switches() - before == 4);
  // outside a pair, yield does nothing
  overlap::yield();
  CHECK(overlap::switches() - before == 4);
}

TEST_CASE("overlap: each half keeps its own autograd mode and trace category across the turns") {
  Comm c = overlap_comm();
  std::vector<float> x((size_t)c.size(), 1.f);
  bool f_grad_after = false, b_grad_after = true;
  std::string f_cat, b_cat;
  REQUIRE(grad_enabled());
  overlap::run_step(
      [&] {  // a forward records the tape
        layer(c, x, 21, nullptr, "F");
        f_grad_after = grad_enabled();
        f_cat = trace().category();
      },
      [&] {  // a backward runs under NoGradGuard, and is suspended inside it
        NoGradGuard ng;
        layer(c, x, 22, nullptr, "B");
        b_grad_after = grad_enabled();
        b_cat = trace().category();
      });
  CHECK(f_grad_after);          // not the backward's NoGradGuard
  CHECK_FALSE(b_grad_after);    // its own
  CHECK(f_cat.empty());         // the forward's spans on the usual tracks
  CHECK(b_cat == "paired backward");
  CHECK(grad_enabled());        // restored after the pair
  CHECK(trace().category().empty());
}

TEST_CASE("overlap: the running half polls the suspended half's messages between its ops") {
  Comm c = overlap_comm();
  int polls = 0, polls_in_first = 0;
  overlap::run_step(
      [&] {  // the forward runs while the backward waits on its messages
        Tensor x = randn({4}, 5);
        x.requires_grad_();
        mul(x, x);  // one op: one poll
        exp(x);     // and another
      },
      [&] {  // the backward starts (kStepOrder) and hands over at once
        overlap::yield([&] { polls++; });  // as a2a_async does between start and finish
        polls_in_first = polls;
        sum_all(exp(randn({4}, 3).requires_grad_())).backward();  // no poll: nothing suspended
      });
  CHECK(polls_in_first == 2);
  CHECK(polls == 2);
}

TEST_CASE("overlap: an error in one half is rethrown once both have ended") {
  Comm c = overlap_comm();
  std::vector<float> x((size_t)c.size(), 1.f);
  bool other_ended = false;
  CHECK_THROWS_WITH(overlap::run_step([&] { throw std::runtime_error("the forward failed"); },
                                      [&] {
                                        layer(c, x, 31, nullptr, "B");
                                        other_ended = true;
                                      }),
                    "the forward failed");
  CHECK(other_ended);
}
