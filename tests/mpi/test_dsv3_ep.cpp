// DeepSeek-V3's expert-parallel MoE layer as one autograd op (dsv3::ep_layer, the whole world
// its EP group) with its backward split into I and W, and both MoE ops under the pipeline
// executor's zero-bubble schedule, at any world size 1..4:
//   1. run_backward(y, dy, &deferred) gives dx bit for bit and no weight gradient; the W that
//      deferred.run() computes moves no byte and calls no collective, and then every gradient
//      equals one backward's (and ep_backward's, called by hand) bit for bit; flat and
//      hierarchical all-to-all;
//   2. the same comparison fails when W is skipped or a bug is planted in the op's gradients;
//   3. under zb-h1 the executor's I steps leave the MoE weights' gradients alone and its W
//      steps compute them (through the schedule's after_compute hook), and the gradients
//      equal 1f1b's (whose B steps compute everything) bit for bit: model::moe_ffn's op on a
//      pipeline over the world, ep_layer's on a one-stage pipeline per rank, EP over the world.
#include <doctest/doctest.h>

#include <string>
#include <utility>
#include <vector>

#include "common/comm/comm.h"
#include "common/core/autograd.h"
#include "common/core/check.h"
#include "common/core/ops.h"
#include "common/core/tensor.h"
#include "common/layers/dsv3_ep.h"
#include "common/layers/expert_parallel.h"
#include "common/layers/model.h"
#include "common/layers/pipeline.h"
#include "common/layers/schedule.h"
#include "lessons/07_dualpipe/schedules.h"

using namespace ff;

namespace {

constexpr int64_t kTokens = 16;  // per rank

// 12 experts: E = 12 / P on P = 1..4 ranks. Capacity with drops, a balance loss, a shared
// expert: every branch of the backward.
dsv3::Config config() {
  dsv3::Config c;
  c.experts = 12, c.topk = 2, c.dim = 16, c.ffn = 16, c.shared = 1;
  c.alpha = 0.01, c.seq_len = 8, c.capacity_factor = 1.0;
  return c;
}

// This rank's leaves: the router and shared experts (replicated), its experts, its tokens.
struct EPLeaves {
  dsv3::Params p;
  Tensor u;
  EPLeaves(const dsv3::Config& c, int P, int r) {
    const int64_t E = c.experts / P;
    p = dsv3::slice_experts(dsv3::init_params(c, 51, 0.1, Device::cpu), r * E, (r + 1) * E);
    for (Tensor* t : {&p.router_w, &p.w1, &p.w3, &p.w2, &p.sw1, &p.sw3, &p.sw2})
      *t = t->detach().clone().requires_grad_();
    u = randn({kTokens, c.dim}, 60 + (uint64_t)r).requires_grad_();
  }
  std::vector<std::pair<std::string, Tensor>> grads() const {
    return {{"dx", u.grad()},        {"router_w", p.router_w.grad()}, {"w1", p.w1.grad()},
            {"w3", p.w3.grad()},     {"w2", p.w2.grad()},             {"sw1", p.sw1.grad()},
            {"sw3", p.sw3.grad()},   {"sw2", p.sw2.grad()}};
  }
};

// Names of the gradients of `got` missing or not bit for bit those of `want`.
std::vector<std::string> differing(const EPLeaves& got, const EPLeaves& want) {
  std::vector<std::string> out;
  const auto g = got.grads(), w = want.grads();
  for (size_t i = 0; i < g.size(); i++)
    if (!g[i].second.defined() || !bitwise_equal(g[i].second, w[i].second)) out.push_back(g[i].first);
  return out;
}

const std::vector<std::string> kWeights = {"router_w", "w1", "w3", "w2", "sw1", "sw3", "sw2"};

size_t bytes_sent() {
  const LinkBytes b = Comm::bytes_sent();
  return b.intra + b.inter + b.self;
}

}  // namespace

TEST_CASE("dsv3_ep: the EP op's I runs every all-to-all, its W is local; I then W equals one backward bit for bit") {
  Comm world = Comm::world(nullptr, nullptr);
  Comm ep = world.split(0, world.rank());  // its own collective counts
  const int P = ep.size(), r = ep.rank();
  dsv3::Topology topo = dsv3::make_topology(ep, P % 2 == 0 ? 2 : 1);
  const dsv3::Config c = config();
  const Tensor dy = randn({kTokens, c.dim}, 70 + (uint64_t)r);
  for (dsv3::Scheme scheme : {dsv3::Scheme::flat, dsv3::Scheme::hierarchical}) {
    CAPTURE(scheme == dsv3::Scheme::flat ? "flat" : "hierarchical");
    EPLeaves full(c, P, r), split(c, P, r);
    run_backward(dsv3::ep_layer(ep, topo, scheme, c, full.p, full.u, nullptr), dy);
    {  // the op's gradients are ep_backward's, in one piece
      NoGradGuard no_grad;
      dsv3::Params w = full.p;
      for (Tensor* t : {&w.router_w, &w.w1, &w.w3, &w.w2, &w.sw1, &w.sw3, &w.sw2}) *t = t->detach();
      const Tensor x = full.u.detach();
      dsv3::EPForward f = dsv3::ep_forward(ep, topo, scheme, c, w, w, x);
      dsv3::Grads g = dsv3::ep_backward(ep, topo, scheme, c, w, w, x, f, dy, dsv3::Bug::none, false);
      CHECK(bitwise_equal(full.u.grad(), g.dx));
      CHECK(bitwise_equal(full.p.router_w.grad(), g.router_w));
      CHECK(bitwise_equal(full.p.w1.grad(), g.w1));
      CHECK(bitwise_equal(full.p.w2.grad(), g.w2));
      CHECK(bitwise_equal(full.p.w3.grad(), g.w3));
      CHECK(bitwise_equal(full.p.sw1.grad(), g.sw1));
    }

    Tensor y = dsv3::ep_layer(ep, topo, scheme, c, split.p, split.u, nullptr);
    DeferredGrads deferred;
    Comm::reset_bytes_sent();
    run_backward(y, dy, &deferred);
    const size_t i_bytes = bytes_sent();
    if (P > 1) CHECK(i_bytes > 0);  // the counter sees the I's all-to-alls
    CHECK(deferred.size() == 1);
    REQUIRE(split.u.grad().defined());
    CHECK(bitwise_equal(split.u.grad(), full.u.grad()));
    for (const auto& [name, g] : split.grads())
      if (name != "dx") CHECK_MESSAGE(!g.defined(), name << " was computed in I");

    Comm::reset_bytes_sent();
    for (Comm* cm : {&ep, &topo.node_comm, &topo.rail_comm}) cm->reset_collective_counts();
    deferred.run();
    CHECK(bytes_sent() == 0);
    for (Comm* cm : {&ep, &topo.node_comm, &topo.rail_comm}) CHECK(cm->collective_counts().empty());
    CHECK(differing(split, full).empty());
  }
}

TEST_CASE("expert parallel: rows through exchange_rows_bf16 arrive as their bf16 rounding, in half the bytes") {
  // what bf16 experts read of their dispatched rows (dsv3_ep.cpp's flat dispatch)
  Comm world = Comm::world(nullptr, nullptr);
  Comm ep = world.split(0, world.rank());
  const int P = ep.size(), r = ep.rank();
  const int64_t d = 6;
  std::vector<std::vector<int64_t>> counts((size_t)P, std::vector<int64_t>((size_t)P, 0));
  for (int p = 0; p < P; p++)
    for (int q = 0; q < P; q++) counts[(size_t)p][(size_t)q] = 1 + (p + 2 * q) % 3;  // rows p sends to q
  const ep::Routes R = ep::routes_from_counts(P, r, P, counts);
  int64_t n = 0;
  for (int q = 0; q < P; q++) n += R.rows_to(q);
  const Tensor rows = randn({n, d}, 90 + (uint64_t)r);
  size_t bytes[2];
  Tensor got[2];
  for (int half = 0; half < 2; half++) {
    Comm::reset_bytes_sent();
    got[half] = half ? ep::exchange_rows_bf16(ep, A2A::async, rows, R.bytes(true, d, 2), R.bytes(false, d, 2), d, 7)
                     : ep::exchange_rows(ep, A2A::async, rows.to_dtype(DType::bf16).to_dtype(DType::f32),
                                         R.bytes(true, d), R.bytes(false, d), d, 7);
    bytes[half] = bytes_sent();
  }
  CHECK(got[1].dtype() == DType::f32);
  CHECK(bitwise_equal(got[0], got[1]));
  CHECK(2 * bytes[1] == bytes[0]);
  if (P > 1) CHECK(!bitwise_equal(got[1], ep::exchange_rows(ep, A2A::async, rows, R.bytes(true, d), R.bytes(false, d), d, 7)));
}

TEST_CASE("dsv3_ep: the EP op's I-then-W check fails with W skipped or a bug planted in the op's gradients") {
  Comm world = Comm::world(nullptr, nullptr);
  const int P = world.size(), r = world.rank();
  dsv3::Topology topo = dsv3::make_topology(world, 1);
  const dsv3::Config c = config();
  const Tensor dy = randn({kTokens, c.dim}, 70 + (uint64_t)r);
  EPLeaves full(c, P, r);
  run_backward(dsv3::ep_layer(world, topo, dsv3::Scheme::flat, c, full.p, full.u, nullptr), dy);
  REQUIRE(max_abs(full.p.w1.grad()) > 0);  // this rank's experts got rows (1% of 0 would be 0)
  SUBCASE("W skipped: every weight's gradient is missing, dx is right") {
    EPLeaves s(c, P, r);
    DeferredGrads deferred;
    run_backward(dsv3::ep_layer(world, topo, dsv3::Scheme::flat, c, s.p, s.u, nullptr), dy, &deferred);
    deferred.clear();
    CHECK(differing(s, full) == kWeights);
  }
  SUBCASE("scale_by_1_01 planted in the op: every gradient, I's and W's, is 1% off") {
    EPLeaves s(c, P, r);
    {
      testing::PlantedBug bug("dsv3_ep", testing::Bug::scale_by_1_01);
      DeferredGrads deferred;
      run_backward(dsv3::ep_layer(world, topo, dsv3::Scheme::flat, c, s.p, s.u, nullptr), dy, &deferred);
      deferred.run();
    }
    std::vector<std::string> all = kWeights;
    all.insert(all.begin(), "dx");
    CHECK(differing(s, full) == all);
    CHECK_FALSE(compare(s.p.w1.grad(), full.p.w1.grad(), 0.0, 1e-3).pass);  // not rounding: 1%
  }
}

// ---- the executor: where the MoE weight gradients are computed
namespace {

// Stage s: y = MoE(x) with stage s's own weights; the first stage draws its micro-batch, the
// last returns sum(y * dy) / M. One MoE op per stage: moe_ffn's, or (ep) ep_layer's.
struct MoEStages : pp::StageModel {
  dsv3::Config c = config();
  int M = 1;
  Comm* ep = nullptr;  // ep_layer's group (nullptr: moe_ffn)
  dsv3::Topology* topo = nullptr;
  std::vector<EPLeaves> stages;  // by stage; ep: every stage's p holds this rank's experts
  Tensor forward(int stage, int gm, const Tensor& x) override {
    const dsv3::Params& p = stages[(size_t)stage].p;
    Tensor in = x.defined() ? x : randn({kTokens, c.dim}, 80 + (uint64_t)gm);
    Tensor y = ep ? dsv3::ep_layer(*ep, *topo, dsv3::Scheme::flat, c, p, in, nullptr)
                  : model::moe_ffn(c, p, in);
    if (stage + 1 < (int)stages.size()) return y;
    return scale(sum_all(mul(y, randn({kTokens, c.dim}, 90 + (uint64_t)gm))), 1.f / (float)M);
  }
  Shape boundary_shape(int, int) const override { return {kTokens, c.dim}; }
  Device device() const override { return Device::cpu; }
};

// Runs `schedule` over pp; returns this rank's stages' weight gradients (flattened, in order)
// and, for each step kind, how many steps changed them.
struct Run {
  std::vector<std::vector<float>> grads;
  int changed[4] = {0, 0, 0, 0};  // by pp::Kind: F, B, I, W
  int steps[4] = {0, 0, 0, 0};
};
Run run_pipeline(Comm& pp_comm, const std::string& schedule, int stages_total, int M, Comm* ep,
                 dsv3::Topology* topo) {
  MoEStages model;
  model.M = M, model.ep = ep, model.topo = topo;
  const int P = ep ? ep->size() : 1, r = ep ? ep->rank() : 0;
  for (int s = 0; s < stages_total; s++) model.stages.emplace_back(model.c, P, r);
  const pp::Schedule sched = pp::make_schedule(schedule, pp_comm.size(), M);
  auto weights = [&] {
    std::vector<std::vector<float>> v;
    for (int s = 0; s < stages_total; s++)
      if (sched.stage_of(pp_comm.rank(), 0) == s)
        for (const auto& [name, g] : model.stages[(size_t)s].grads())
          if (name != "dx") v.push_back(g.defined() ? g.to_vector() : std::vector<float>{});
    return v;
  };
  Run run;
  std::vector<std::vector<float>> before = weights();
  pp::ExecutorOptions opt;
  opt.after_compute = [&](const pp::Step& step, double) {
    std::vector<std::vector<float>> now = weights();
    run.steps[(int)step.op.kind]++;
    run.changed[(int)step.op.kind] += now != before;
    before = std::move(now);
  };
  pp::Executor ex(pp_comm, sched, model, opt);
  ex.run();
  run.grads = weights();
  return run;
}

}  // namespace

TEST_CASE("pipeline: under zb-h1 the MoE ops' weight gradients are computed in the W steps, not in I") {
  Comm world = Comm::world(nullptr, nullptr);
  const int P = world.size(), M = 3;
  using pp::Kind;
  SUBCASE("moe_ffn's op, one stage per rank") {
    Run one = run_pipeline(world, "1f1b", P, M, nullptr, nullptr);
    Run zb = run_pipeline(world, "zb-h1", P, M, nullptr, nullptr);
    CHECK(one.steps[(int)Kind::B] == M);
    CHECK(one.changed[(int)Kind::B] == M);  // each B computes them
    CHECK(zb.steps[(int)Kind::I] == M);
    CHECK(zb.changed[(int)Kind::I] == 0);   // no I touches them
    CHECK(zb.steps[(int)Kind::W] == M);
    CHECK(zb.changed[(int)Kind::W] == M);   // each W does
    CHECK(zb.changed[(int)Kind::F] == 0);
    CHECK(zb.grads == one.grads);           // the same bits
  }
  SUBCASE("ep_layer's op, EP over the world, a one-stage pipeline per rank") {
    Comm self = world.split(world.rank(), 0);
    Comm ep = world.split(0, world.rank());
    dsv3::Topology topo = dsv3::make_topology(ep, 1);
    Run one = run_pipeline(self, "1f1b", 1, M, &ep, &topo);
    Run zb = run_pipeline(self, "zb-h1", 1, M, &ep, &topo);
    CHECK(one.changed[(int)Kind::B] == M);
    CHECK(zb.steps[(int)Kind::I] == M);
    CHECK(zb.changed[(int)Kind::I] == 0);
    CHECK(zb.changed[(int)Kind::W] == M);
    CHECK(zb.grads == one.grads);
  }
}
