// common/autograd.h — reverse-mode autograd on a dynamic tape (define-by-run).
//
// Design rule: a Node's backward returns one gradient per input (an undefined
// Tensor where an input needs none); the engine accumulates (+=) them into the
// inputs, so a tensor used twice gets the sum. Backward closures must not capture
// their own output Tensor (that would make a reference cycle): capture
// output.detach() instead.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "common/tensor.h"

namespace ff {

struct Node {
  std::string name;                // the op, e.g. "softmax"
  std::vector<Tensor> inputs;      // the tensors the op read
  std::function<std::vector<Tensor>(const Tensor& grad_output)> backward;
};

// Whether ops record the tape (true unless a NoGradGuard is alive on this thread).
bool grad_enabled();

struct NoGradGuard {
  NoGradGuard();
  ~NoGradGuard();
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};

// Attaches the tape entry to `out` when grad mode is on and some input requires grad.
// Returns out (now requiring grad if recorded).
Tensor record(Tensor out, const std::string& name, std::vector<Tensor> inputs,
              std::function<std::vector<Tensor>(const Tensor& grad_output)> backward);

// Runs the reverse walk from `root`, seeded with `grad_output` (same shape as root).
void run_backward(const Tensor& root, const Tensor& grad_output);

// ---- test-only: plant a bug in one op's backward, so tests can show a check catches it.
namespace testing {
enum class Bug { none, flip_sign, drop_first_input, scale_by_1_01 };
// Every backward of op `name` has its returned gradients altered as `bug` says.
// plant_bug("", Bug::none) removes it.
void plant_bug(const std::string& name, Bug bug);
struct PlantedBug {  // RAII form for tests
  PlantedBug(const std::string& name, Bug bug) { plant_bug(name, bug); }
  ~PlantedBug() { plant_bug("", Bug::none); }
};
}  // namespace testing

}  // namespace ff
