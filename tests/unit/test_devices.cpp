// Devices: .to(device) copies, mixing devices is an error, and autograd through tensors on
// the device under test (sim, or cuda on a GPU) gives the same values and gradients as
// through cpu, for a graph that uses every op of common/core/ops.h.
#include <cmath>
#include <string>
#include <vector>

#include "common/core/check.h"
#include "common/core/ops.h"
#include "tests/unit/kernel_check.h"

using namespace ff;

namespace {

// The graph below chains ~30 ops; each device rounds differently inside its kernels (float
// accumulation order in sums, matmuls and softmax rows). Relative differences of a few
// 1e-6 per op compound to ~1e-5; 1e-4 relative (with an absolute floor for gradients near
// zero) leaves room for that while a wrong kernel or backward is off by far more.
constexpr double kGraphRtol = 1e-4;
constexpr double kGraphAtol = 1e-5;

struct Inputs {
  Tensor x, w, wb, g, emb, base, src;
  std::vector<Tensor*> leaves() { return {&x, &w, &wb, &g, &emb, &base, &src}; }
};

Inputs make_inputs(Device d) {
  Inputs in;
  in.x = randn({2, 4, 6}, 1).to(d);
  in.w = randn({6, 5}, 2).to(d);
  in.wb = randn({2, 5, 3}, 3).to(d);
  in.g = rand_uniform({5}, 4, 0.5f, 1.5f).to(d);
  in.emb = randn({7, 3}, 5).to(d);
  in.base = randn({7, 3}, 6).to(d);
  in.src = randn({4, 3}, 7).to(d);
  for (Tensor* t : in.leaves()) t->requires_grad_();
  return in;
}

// Every op of common/core/ops.h, composed into one scalar loss.
Tensor every_op_loss(Inputs& in) {
  Device d = in.x.device();
  Tensor positions = Tensor::from_indices({100000, 3}, {2}).to(d);
  Tensor h = matmul(rope(in.x, positions), in.w);        // 2 tokens of 4 heads; (6, 5)
  h = rmsnorm(h, in.g);
  h = silu(h) + sigmoid(h) * relu(h) - neg(h) / add_scalar(exp(h), 1.f);
  Tensor hb = matmul(h, in.wb);                          // batched: (2, 4, 5) @ (2, 5, 3)
  hb = transpose(hb, 0, 1);                              // (4, 2, 3)
  hb = reshape(hb, {4, 6});
  Tensor left = slice(hb, 1, 0, 3), right = slice(hb, 1, 3, 6);
  Tensor cat = concat({left * 0.5f, add_scalar(right, 1.f)}, 0);  // (8, 3)
  Tensor mask = Tensor::from_vector({0, 1, 0}, {3}).to(d);
  Tensor sm = softmax(masked_fill(cat, mask, -1e9f));
  Tensor ls = log_softmax(cat);
  Tensor targets = Tensor::from_indices({0, 2, 1, 1, 0, 2, 2, 0}, {8}).to(d);
  Tensor ce = cross_entropy(cat, targets);
  Tensor idx = Tensor::from_indices({6, 0, 6, 3}, {4}).to(d);
  Tensor e = embedding(in.emb, idx);                     // (4, 3)
  Tensor ia = index_add(in.base, idx, in.src);           // repeated index 6
  Tensor sel = index_select(ia, idx);
  auto [top, top_idx] = topk(e * sel, 2);
  Tensor pos = add_scalar(exp(scale(sm, 0.5f)), 0.1f);
  Tensor tail = sqrt(pos) + log(pos) / pos;
  return sum_all(tail) - sum_all(neg(mean(ls, 0, true))) + ce + sum_all(max(top, 1)) +
         sum_all(sum(sel, 0)) + sum_all(e);
}

}  // namespace

TEST_SUITE("kernels") {

TEST_CASE("devices: .to() copies both ways, and mixing devices is an error naming both") {
  Device d = kt::device_under_test();
  Tensor x = randn({3, 5}, 9);
  Tensor xd = x.to(d);
  CHECK(xd.device() == d);
  CHECK(bitwise_equal(xd.to(Device::cpu), x));
  Tensor idx = Tensor::from_indices({4, 0, 2}, {3}).to(d);
  CHECK(idx.to_index_vector() == std::vector<int64_t>{4, 0, 2});
  try {
    add(x, xd);
    FAIL("adding a cpu and a " << device_name(d) << " tensor did not throw");
  } catch (const Error& e) {
    std::string msg = e.what();
    CHECK(msg.find("different devices") != std::string::npos);
    CHECK(msg.find(device_name(d)) != std::string::npos);
  }
}

TEST_CASE("devices: autograd through every op gives the cpu values and gradients") {
  Device d = kt::device_under_test();
  Inputs on_cpu = make_inputs(Device::cpu), on_dev = make_inputs(d);
  Tensor loss_cpu = every_op_loss(on_cpu), loss_dev = every_op_loss(on_dev);
  REQUIRE(loss_dev.device() == d);
  kt::require_close(loss_dev, loss_cpu, kGraphAtol, kGraphRtol, "loss");
  loss_cpu.backward();
  loss_dev.backward();
  const char* names[] = {"x", "w", "wb", "g", "emb", "base", "src"};
  auto lc = on_cpu.leaves(), ld = on_dev.leaves();
  for (size_t i = 0; i < lc.size(); i++) {
    REQUIRE_MESSAGE(ld[i]->grad().defined(), "no gradient for " << names[i]);
    CHECK(ld[i]->grad().device() == d);
    kt::require_close(ld[i]->grad(), lc[i]->grad(), kGraphAtol, kGraphRtol,
                      std::string("d loss / d ") + names[i]);
  }
}

}  // TEST_SUITE
