// common/core/autograd.h — reverse-mode autograd on a dynamic tape (define-by-run).
//
// Design rule: a Node's backward returns one gradient per input (an undefined
// Tensor where an input needs none); the engine accumulates (+=) them into the
// inputs, so a tensor used twice gets the sum. Backward closures must not capture
// their own output Tensor (that would make a reference cycle): capture
// output.detach() instead.
#pragma once
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "common/core/tensor.h"

namespace ff {

// What a split backward (see Node) returns: the input gradients now, and the weight
// gradients as a computation to run now or later. `weights` returns one gradient per weight
// input, in Node::weight_inputs' order; what it needs (activations, output gradients, whatever
// the input half computed for it) lives in its captures.
struct SplitGrads {
  std::vector<Tensor> inputs;  // one per input, the weights' left undefined
  std::function<std::vector<Tensor>()> weights;
};

struct Node {
  std::string name;                // the op, e.g. "softmax"
  std::vector<Tensor> inputs;      // the tensors the op read
  std::function<std::vector<Tensor>(const Tensor& grad_output)> backward;
  // Ops with weights (matmul's 2-D right operand; the MoE layers' expert, router and shared
  // matrices) can split their backward in two, as zero-bubble pipeline schedules need: input
  // gradients now ("I"), weight gradients later ("W"). Then weight_inputs holds the weights'
  // indices in inputs and split_backward gives both halves; backward is the one, then the other.
  std::vector<int> weight_inputs;
  std::function<SplitGrads(const Tensor& grad_output)> split_backward;
};

// Weight gradients set aside by run_backward(root, g, &deferred), one entry per op, in the
// order the reverse walk met them; run() computes them and accumulates them into the weights'
// .grad. Holding them keeps alive what they need (the op's input activation and its output
// gradient, or what its input half computed for them): a deferred W costs memory until it runs.
class DeferredGrads {
 public:
  bool empty() const { return pending_.empty(); }
  size_t size() const { return pending_.size(); }
  void run();
  // Runs the oldest one still pending (false: none was): lesson 06 runs them one at a time
  // while it waits for a message.
  bool run_next();
  void clear() { pending_.clear(); }

 private:
  friend void run_backward(const Tensor&, const Tensor&, DeferredGrads*,
                           const std::function<void()>&);
  std::deque<std::function<void()>> pending_;
};

// Whether ops record the tape (true unless a NoGradGuard is alive on this thread).
bool grad_enabled();
// Sets it, for code that switches between call stacks on one thread (common/comm/overlap.h:
// each keeps its own mode); everything else uses NoGradGuard.
void set_grad_enabled(bool on);

// A function called between ops on this thread: after each op of the core (every op passes
// through record(), taped or not, under NoGradGuard too) and after each op's backward in
// run_backward. Communication in flight progresses only inside MPI calls, so
// a rank that computes while its messages travel polls them here (common/comm/overlap.h
// installs one for its paired halves). An empty function: none (the default).
void set_between_ops(std::function<void()> fn);

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

// The same for an op whose backward splits into input and weight halves (see Node).
Tensor record_split(Tensor out, const std::string& name, std::vector<Tensor> inputs,
                    std::vector<int> weight_inputs,
                    std::function<SplitGrads(const Tensor& grad_output)> split_backward);
// One weight (matmul): input_backward returns every gradient but the weight's (left
// undefined), weight_backward the weight's.
Tensor record_split(Tensor out, const std::string& name, std::vector<Tensor> inputs,
                    int weight_input,
                    std::function<std::vector<Tensor>(const Tensor& grad_output)> input_backward,
                    std::function<Tensor(const Tensor& grad_output)> weight_backward);

// Runs the reverse walk from `root`, seeded with `grad_output` (same shape as root). A leaf is
// finished, its gradient added into .grad and its post_accumulate_grad hook called, as soon as
// the last op that read it has had its turn (tensor.h).
// With `deferred`, every splittable op whose weights are all leaves that require grad
// computes only its input gradients now and leaves its weight gradients in *deferred (the "I"
// of a zero-bubble schedule; deferred->run() is its "W"). after_each_op, when given, is called
// after each op's backward (lesson 06 polls its messages there, between the compute tiles).
void run_backward(const Tensor& root, const Tensor& grad_output, DeferredGrads* deferred = nullptr,
                  const std::function<void()>& after_each_op = {});

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
