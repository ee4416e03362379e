// ZeRO-3 under mpirun (lessons/08_mesh/fsdp.h), the whole world one group: a two-unit model's
// training steps equal ZeRO-0's (bit for bit at dp <= 2, where a sum of two is one addition;
// within float rounding beyond), the weights are really freed between uses, and the planted
// bug (the backward on freed weights) is caught.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "common/comm/comm.h"
#include "common/core/autograd.h"
#include "common/core/ops.h"
#include "common/core/tensor.h"
#include "lessons/08_mesh/fsdp.h"
#include "lessons/08_mesh/zero.h"
#include "common/util/error.h"

using namespace ff;

namespace {

Comm world() { return Comm::world(nullptr, nullptr); }
const AdamConfig kAdam{/*lr=*/1e-2, /*beta1=*/0.9, /*beta2=*/0.999, /*eps=*/1e-8, /*weight_decay=*/0.1};

struct TwoUnits {  // unit 0: w0 (7); unit 1: w1 (7), w2 (7): y = w0 * x; loss = sum(w1 * y) + sum(w2 * y * y)
  std::vector<Tensor> w;
  TwoUnits() {
    for (uint64_t i = 0; i < 3; i++) w.push_back(randn({7}, 500 + i)), w.back().requires_grad_();
  }
  std::vector<Tensor*> ptrs() { return {&w[0], &w[1], &w[2]}; }
  // this rank's loss at step s; around each unit the hooks of f (nullptr: none)
  Tensor loss(int rank, int s, fsdp::Fsdp* f) {
    const Tensor x = randn({7}, 9000 + 10 * (uint64_t)s + (uint64_t)rank);
    if (f) f->before_forward(0);
    Tensor y = mul(w[0], x);
    if (f) y = f->after_forward(0, y), f->before_forward(1);
    Tensor l = add(sum_all(mul(w[1], y)), sum_all(mul(w[2], mul(y, y))));
    if (f) l = f->after_forward(1, l);
    return l;
  }
};

}  // namespace

TEST_CASE("fsdp: ZeRO-3 trains a two-unit model as ZeRO-0 does") {
  Comm c = world();
  TwoUnits a, b;
  zero::DataParallelAdam z0(c, kAdam);
  fsdp::ShardGroup group(c, kAdam, 2);
  group.add(&b.w[0], 0), group.add(&b.w[1], 1), group.add(&b.w[2], 1);
  fsdp::Fsdp f({&group}, 2);
  f.start();
  // between uses the weights are gone: their storage released, reading them an error
  CHECK(b.w[1].impl()->storage->bytes == 0);
  CHECK_THROWS_AS(b.w[1].to_vector(), ff::Error);
  for (int s = 0; s < 3; s++) {
    for (Tensor& w : a.w) w.zero_grad();
    a.loss(c.rank(), s, nullptr).backward();
    z0.step(a.ptrs());
    b.loss(c.rank(), s, &f).backward();
    f.end_backward();
    group.step();
  }
  f.gather_all();
  for (int i = 0; i < 3; i++) {
    const std::vector<float> x = a.w[i].to_vector(), y = b.w[i].to_vector();
    double worst = 0;
    for (size_t k = 0; k < x.size(); k++) worst = std::max(worst, std::fabs((double)x[k] - y[k]));
    CAPTURE(i);
    if (c.size() <= 2) CHECK(x == y);  // one addition per sum: the same bits
    else CHECK(worst < 1e-5);          // the sums' orders may differ
  }
  f.free_all();
  // never both units at once: the larger, unit 1 (w1 and w2, 14 numbers), is the most gathered
  CHECK(f.peak_gathered_bytes() == 14 * sizeof(float));
}

TEST_CASE("fsdp: the backward on freed weights (the planted bug) changes the gradients") {
  Comm c = world();
  std::vector<float> mean[2];
  for (int bug = 0; bug < 2; bug++) {
    TwoUnits m;
    fsdp::ShardGroup group(c, kAdam, 2);
    group.add(&m.w[0], 0), group.add(&m.w[1], 1), group.add(&m.w[2], 1);
    group.stale_backward = bug == 1;
    fsdp::Fsdp f({&group}, 2);
    f.start();
    m.loss(c.rank(), 0, &f).backward();
    f.end_backward();
    group.step();
    Comm check = c.split(0, c.rank());
    for (const Tensor& g : group.mean_grads(check))
      for (float v : g.to_vector()) mean[bug].push_back(v);
  }
  CHECK(mean[0] != mean[1]);
}
