// Goldens: our ops (common/core/ops.h) with autograd against PyTorch, on the inputs, upstream
// gradients and float64 answers that tests/reference/ops.py wrote into tests/reference/data
// (`make reference` regenerates them; the binary runs from the repository root).
//
// Every case loads its inputs, runs forward, calls backward(dy) with the saved dy, and
// compares outputs and input gradients with a named tolerance. The last test plants a bug
// in one backward per case and checks that the same comparison then fails.
// Set FF_GOLDEN_VERBOSE=1 to print every comparison, passing or not.
#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "common/core/autograd.h"
#include "common/core/check.h"
#include "common/core/npy.h"
#include "common/core/ops.h"
#include "common/core/tensor.h"

using namespace ff;
using ff::testing::Bug;
using ff::testing::PlantedBug;

namespace {

const std::string kDataDir = "tests/reference/data";

// ---- tolerances: |got - want| <= atol + rtol * |want| for every element.
// The goldens are float64 math rounded once to float32, so each budget is our float32
// error alone; float32's unit roundoff is u = 2^-24 ~ 6e-8.
struct Tolerance {
  double atol, rtol;
};
// A handful of float32 operations per element (exp, a division, a product): a few u.
// The absolute floor covers cancellation, as in silu' = s (1 + x (1 - s)) near its zero
// at x ~ -1.28, where the error is a few u of the O(1) terms, not of the result.
constexpr Tolerance kElementwiseTol = {1e-6, 1e-5};
// Row reductions (softmax, log_softmax, rmsnorm) over C <= 16 entries, float32 in and out:
// each output is a few roundings plus one of the row sum: ~10 u relative. Backward has a
// difference dy - <dy, y> that can cancel, hence the absolute floor.
constexpr Tolerance kRowTol = {2e-6, 1e-5};
// Cross-entropy with one row of logits up to ~400 in magnitude: lse and logp = z - lse are
// float32 numbers of that size, each rounded once, half an ulp(400) = 1.5e-5 each: up to
// 3e-5 absolute. The probabilities exp(z - lse) inherit that as up to 3e-5 relative.
constexpr Tolerance kLargeLogitTol = {5e-5, 5e-5};
// float32 matmul, K <= 7 terms of O(1) products: the sum's rounding grows like K u times
// sum |a_k b_k| (even when the result is small): ~1e-6 absolute, 1e-5 relative.
constexpr Tolerance kMatmulTol = {2e-6, 1e-5};
// The 2-layer MLP composes K = 16 and 32 term matmuls, silu and cross-entropy; errors of
// each layer propagate through the next: ~1e-5 relative, with an absolute floor for the
// small gradient entries.
constexpr Tolerance kMlpTol = {1e-6, 1e-5};
// RoPE: each output component is x[2i] cos a -+ x[2i+1] sin a, which may cancel, so its error
// is bounded by rho = |x[2i]| + |x[2i+1]|, not by the result. On the devices that form the
// float sincosf of a double-reduced angle (sim, cuda): <= (2 + pi + 3) u rho
// (tests/unit/test_kernels_rope.cpp), cpu (all double, one rounding) <= u rho; the golden's own
// rounding adds u rho. The inputs and dy are below 3.7, so rho < 7.4: < 5e-6 absolute. 1e-5;
// a 1% error (scale_by_1_01) or a wrong angle is off by 1e-2 or more.
constexpr Tolerance kRopeTol = {1e-5, 0};

// ---- loading
std::string data_path(const std::string& case_name, const std::string& tensor) {
  return kDataDir + "/" + case_name + "_" + tensor + ".npy";
}

void require_data_dir() {
  REQUIRE_MESSAGE(std::filesystem::is_directory(kDataDir),
                  "golden data directory " << kDataDir << " not found: run the tests from the "
                  "repository root (regenerate the data with `make reference`)");
}

struct Golden {
  std::string case_name;  // the file prefix in kDataDir
  Device device;
  std::string label = case_name;  // how comparisons are named (a case may reuse files)
  Tensor get(const std::string& tensor) const { return load_npy(data_path(case_name, tensor)).to(device); }
  Tensor leaf(const std::string& tensor) const {
    Tensor t = get(tensor);
    t.requires_grad_();
    return t;
  }
};

// ---- one comparison and a report of all of a case
struct Comparison {
  std::string name;  // "<case> <tensor> on <device>"
  Diff diff;
  Tolerance tol;
};
using Report = std::vector<Comparison>;

void compare_into(Report& r, const Golden& g, const std::string& tensor, const Tensor& got,
                  Tolerance tol) {
  Tensor want = g.get(tensor);
  REQUIRE_MESSAGE(got.defined(), g.label << " " << tensor << ": no value (no gradient reached it)");
  if (want.numel() == 1 && got.numel() == 1) want = want.view(got.shape());  // loss: () vs (1)
  std::string name = g.label + " " + tensor + " on " + device_name(g.device);
  r.push_back({name, compare(got, want, tol.atol, tol.rtol), tol});
}

const Comparison& find(const Report& r, const std::string& case_tensor) {
  for (const Comparison& c : r)
    if (c.name.rfind(case_tensor + " on ", 0) == 0) return c;
  FAIL("no comparison named " << case_tensor);
  return r.front();
}

void check_report(const Report& r) {
  static const bool verbose = std::getenv("FF_GOLDEN_VERBOSE") != nullptr;
  for (const Comparison& c : r) {
    if (verbose)
      std::printf("  %-44s max abs %.3g  max rel %.3g  (atol %.0e, rtol %.0e)%s\n", c.name.c_str(),
                  c.diff.max_abs, c.diff.max_rel, c.tol.atol, c.tol.rtol, c.diff.pass ? "" : "  FAIL");
    CHECK_MESSAGE(c.diff.pass, c.name << ": max abs " << c.diff.max_abs << ", max rel "
                                      << c.diff.max_rel << " exceed atol " << c.tol.atol
                                      << " + rtol " << c.tol.rtol << " * |want|");
  }
}

// ---------------------------------------------------------------------------
// the cases: each runs forward and backward(dy) and compares everything it produced

Report unary_case(const std::string& case_name, Device d, Tensor (*op)(const Tensor&), Tolerance tol) {
  Golden g{case_name, d};
  Tensor x = g.leaf("x");
  Tensor y = op(x);
  y.backward(g.get("dy"));
  Report r;
  compare_into(r, g, "y", y, tol);
  compare_into(r, g, "dx", x.grad(), tol);
  return r;
}

Report softmax_case(Device d) { return unary_case("softmax", d, softmax, kRowTol); }
// values ~ +-1000: exp overflows unless the row max is subtracted first
Report softmax_large_case(Device d) { return unary_case("softmax_large", d, softmax, kRowTol); }
Report silu_case(Device d) { return unary_case("silu", d, silu, kElementwiseTol); }
Report sigmoid_case(Device d) { return unary_case("sigmoid", d, sigmoid, kElementwiseTol); }

// The cross_entropy op, against PyTorch's log_softmax + nll_loss.
Report cross_entropy_case(Device d) {
  Golden g{"cross_entropy", d};
  Tensor logits = g.leaf("logits");
  Tensor loss = cross_entropy(logits, g.get("targets"));
  loss.backward(g.get("dy").view(loss.shape()));
  Report r;
  compare_into(r, g, "loss", loss, kLargeLogitTol);
  compare_into(r, g, "dlogits", logits.grad(), kLargeLogitTol);
  return r;
}

// The same loss composed as log_softmax, then NLL = -mean(sum(logp * onehot(targets))):
// checks log_softmax's own forward and backward on the same goldens.
Report log_softmax_nll_case(Device d) {
  Golden g{"cross_entropy", d, "log_softmax_nll"};
  Tensor logits = g.leaf("logits");
  std::vector<int64_t> targets = g.get("targets").to_index_vector();
  int64_t N = logits.size(0), V = logits.size(1);
  std::vector<float> onehot((size_t)(N * V), 0.f);
  for (int64_t i = 0; i < N; i++) onehot[(size_t)(i * V + targets[(size_t)i])] = 1.f;
  Tensor logp = log_softmax(logits);
  Tensor loss = scale(sum_all(mul(logp, Tensor::from_vector(onehot, {N, V}, d))), -1.f / (float)N);
  loss.backward(g.get("dy").view(loss.shape()));
  Report r;
  compare_into(r, g, "logp", logp, kLargeLogitTol);
  compare_into(r, g, "loss", loss, kLargeLogitTol);
  compare_into(r, g, "dlogits", logits.grad(), kLargeLogitTol);
  return r;
}

Report rmsnorm_case(Device d) {
  Golden g{"rmsnorm", d};
  Tensor x = g.leaf("x"), weight = g.leaf("weight");
  Tensor y = rmsnorm(x, weight, g.get("eps").item());
  y.backward(g.get("dy"));
  Report r;
  compare_into(r, g, "y", y, kRowTol);
  compare_into(r, g, "dx", x.grad(), kRowTol);
  // dweight sums dy * xhat over the 6 rows: one more short reduction
  compare_into(r, g, "dweight", weight.grad(), kRowTol);
  return r;
}

Report matmul_case(const std::string& case_name, Device d) {
  Golden g{case_name, d};
  Tensor a = g.leaf("a"), b = g.leaf("b");
  Tensor c = matmul(a, b);
  c.backward(g.get("dy"));
  Report r;
  compare_into(r, g, "c", c, kMatmulTol);
  compare_into(r, g, "da", a.grad(), kMatmulTol);
  compare_into(r, g, "db", b.grad(), kMatmulTol);  // matmul_shared: summed over the batch too
  return r;
}
Report matmul_2d_case(Device d) { return matmul_case("matmul", d); }
Report matmul_batched_case(Device d) { return matmul_case("matmul_batched", d); }
Report matmul_shared_case(Device d) { return matmul_case("matmul_shared", d); }

// x (8, 16) -> x @ w1 + b1 -> silu -> @ w2 + b2 -> cross_entropy(targets)
Report mlp_case(Device d) {
  Golden g{"mlp", d};
  Tensor x = g.leaf("x"), w1 = g.leaf("w1"), b1 = g.leaf("b1"), w2 = g.leaf("w2"), b2 = g.leaf("b2");
  Tensor h = silu(add(matmul(x, w1), b1));  // b1 (32) broadcasts over the rows
  Tensor logits = add(matmul(h, w2), b2);
  Tensor loss = cross_entropy(logits, g.get("targets"));
  loss.backward(g.get("dy").view(loss.shape()));
  Report r;
  compare_into(r, g, "loss", loss, kMlpTol);
  for (auto [name, t] : {std::pair<const char*, Tensor>{"dx", x}, {"dw1", w1}, {"db1", b1},
                         {"dw2", w2}, {"db2", b2}})
    compare_into(r, g, name, t.grad(), kMlpTol);
  return r;
}

// RoPE, against DeepSeek-V3's apply_rotary_emb (view_as_complex times polar) in float64:
// x (7, 3, 16) of 3 heads sharing each token's position, and a (5, 64) k_pe; the saved
// positions are unsorted and reach 100000.
Report rope_case(const std::string& case_name, Device d) {
  Golden g{case_name, d};
  Tensor x = g.leaf("x");
  Tensor y = rope(x, g.get("positions"), g.get("theta").item());
  y.backward(g.get("dy"));
  Report r;
  compare_into(r, g, "y", y, kRopeTol);
  compare_into(r, g, "dx", x.grad(), kRopeTol);
  return r;
}
Report rope_q_case(Device d) { return rope_case("rope", d); }
Report rope_k_case(Device d) { return rope_case("rope_k", d); }

struct Case {
  const char* name;
  Report (*run)(Device);
};
const Case kCases[] = {
    {"softmax", softmax_case},
    {"softmax_large", softmax_large_case},
    {"cross_entropy", cross_entropy_case},
    {"log_softmax_nll", log_softmax_nll_case},
    {"rmsnorm", rmsnorm_case},
    {"matmul", matmul_2d_case},
    {"matmul_batched", matmul_batched_case},
    {"matmul_shared", matmul_shared_case},
    {"silu", silu_case},
    {"sigmoid", sigmoid_case},
    {"mlp", mlp_case},
    {"rope", rope_q_case},
    {"rope_k", rope_k_case},
};

// cpu always; sim and cuda when this build and machine have them
std::vector<Device> golden_devices() {
  std::vector<Device> ds;
  for (Device d : {Device::cpu, Device::sim, Device::cuda})
    if (device_available(d)) ds.push_back(d);
  return ds;
}

}  // namespace

TEST_CASE("golden: ops and their gradients match PyTorch (tests/reference/data)") {
  require_data_dir();
  for (Device d : golden_devices())
    for (const Case& c : kCases) {
      INFO("case " << std::string(c.name) << " on " << std::string(device_name(d)));
      check_report(c.run(d));
    }
}

TEST_CASE("golden: a bug planted in a backward makes the same comparison fail") {
  require_data_dir();
  // Each row: a case, a bug in one op's backward, and a gradient the bug must spoil.
  // scale_by_1_01 (a 1% error) shows the tolerances are far tighter than a real mistake.
  struct Planted {
    Report (*run)(Device);
    const char* op;
    Bug bug;
    const char* spoiled;  // "<case> <tensor>"
  } planted[] = {
      {mlp_case, "silu", Bug::flip_sign, "mlp dw1"},
      {mlp_case, "silu", Bug::flip_sign, "mlp dx"},
      {mlp_case, "add", Bug::scale_by_1_01, "mlp db2"},
      {mlp_case, "cross_entropy", Bug::scale_by_1_01, "mlp dw2"},
      {softmax_case, "softmax", Bug::scale_by_1_01, "softmax dx"},
      {softmax_large_case, "softmax", Bug::flip_sign, "softmax_large dx"},
      {cross_entropy_case, "cross_entropy", Bug::scale_by_1_01, "cross_entropy dlogits"},
      {log_softmax_nll_case, "log_softmax", Bug::scale_by_1_01, "log_softmax_nll dlogits"},
      {rmsnorm_case, "rmsnorm", Bug::scale_by_1_01, "rmsnorm dx"},
      {rmsnorm_case, "rmsnorm", Bug::scale_by_1_01, "rmsnorm dweight"},
      {matmul_2d_case, "matmul", Bug::drop_first_input, "matmul da"},
      {matmul_batched_case, "matmul", Bug::scale_by_1_01, "matmul_batched db"},
      {matmul_shared_case, "matmul", Bug::scale_by_1_01, "matmul_shared db"},
      {silu_case, "silu", Bug::scale_by_1_01, "silu dx"},
      {sigmoid_case, "sigmoid", Bug::scale_by_1_01, "sigmoid dx"},
      {rope_q_case, "rope", Bug::flip_sign, "rope dx"},
      {rope_k_case, "rope", Bug::scale_by_1_01, "rope_k dx"},
  };
  for (const Planted& p : planted) {
    INFO("bug planted in " << std::string(p.op) << " backward; expecting " << std::string(p.spoiled)
                           << " to fail");
    Report clean = p.run(Device::cpu);
    CHECK(find(clean, p.spoiled).diff.pass);  // the same comparison passes without the bug
    PlantedBug bug(p.op, p.bug);
    Report buggy = p.run(Device::cpu);
    const Comparison& c = find(buggy, p.spoiled);
    CHECK_FALSE(c.diff.pass);
  }
}
