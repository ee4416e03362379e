// common/core/autograd.cpp — the tape and the reverse walk (a topological sort, as in micrograd).
#include "common/core/autograd.h"

#include <algorithm>
#include <deque>
#include <unordered_map>
#include <unordered_set>

#include "common/core/check.h"
#include "kernels/kernels.h"

namespace ff {

static thread_local bool g_grad_enabled = true;

bool grad_enabled() { return g_grad_enabled; }
void set_grad_enabled(bool on) { g_grad_enabled = on; }

static thread_local std::function<void()> g_between_ops;
void set_between_ops(std::function<void()> fn) { g_between_ops = std::move(fn); }
NoGradGuard::NoGradGuard() : prev_(g_grad_enabled) { g_grad_enabled = false; }
NoGradGuard::~NoGradGuard() { g_grad_enabled = prev_; }

namespace testing {
static std::string g_bug_op;
static Bug g_bug = Bug::none;
void plant_bug(const std::string& name, Bug bug) {
  g_bug_op = name;
  g_bug = bug;
}
}  // namespace testing

Tensor record(Tensor out, const std::string& name, std::vector<Tensor> inputs,
              std::function<std::vector<Tensor>(const Tensor&)> backward) {
  if (g_between_ops) g_between_ops();
  if (!grad_enabled()) return out;
  bool any = false;
  for (const Tensor& t : inputs) any = any || t.requires_grad();
  if (!any) return out;
  auto node = std::make_shared<Node>();
  node->name = name;
  node->inputs = std::move(inputs);
  node->backward = std::move(backward);
  out.impl()->grad_fn = node;
  out.impl()->requires_grad = true;
  return out;
}

Tensor record_split(Tensor out, const std::string& name, std::vector<Tensor> inputs,
                    std::vector<int> weight_inputs,
                    std::function<SplitGrads(const Tensor&)> split_backward) {
  FF_CHECK(!weight_inputs.empty(), name << ": a split backward without a weight input");
  for (int w : weight_inputs)
    FF_CHECK(w >= 0 && w < (int)inputs.size(), name << ": weight input " << w << " out of range");
  auto full = [split_backward, weight_inputs, name](const Tensor& g) {
    SplitGrads s = split_backward(g);
    std::vector<Tensor> w = s.weights();
    FF_CHECK(w.size() == weight_inputs.size(), "weight backward of " << name << " returned "
                 << w.size() << " gradients for " << weight_inputs.size() << " weights");
    for (size_t k = 0; k < w.size(); k++) s.inputs[(size_t)weight_inputs[k]] = w[k];
    return s.inputs;
  };
  out = record(out, name, std::move(inputs), full);
  if (Node* node = out.impl()->grad_fn.get()) {
    node->weight_inputs = std::move(weight_inputs);
    node->split_backward = std::move(split_backward);
  }
  return out;
}

Tensor record_split(Tensor out, const std::string& name, std::vector<Tensor> inputs,
                    int weight_input,
                    std::function<std::vector<Tensor>(const Tensor&)> input_backward,
                    std::function<Tensor(const Tensor&)> weight_backward) {
  auto split = [input_backward = std::move(input_backward),
                weight_backward = std::move(weight_backward)](const Tensor& g) {
    return SplitGrads{input_backward(g), [weight_backward, g] {
                        return std::vector<Tensor>{weight_backward(g)};
                      }};
  };
  return record_split(out, name, std::move(inputs), std::vector<int>{weight_input}, split);
}

// acc += g (both on the same device, same shape); the first gradient to arrive becomes acc.
// When nothing else holds that one — no other handle to it, no view of its storage — it is
// taken as it is rather than copied (as PyTorch's AccumulateGrad steals a gradient no one else
// references): adding into it later changes nothing anyone else can see. Otherwise it is
// cloned. Callers hand g over (moved).
static void accumulate(std::shared_ptr<TensorImpl>& acc, std::shared_ptr<TensorImpl> g) {
  if (!acc) {
    const bool alone = g.use_count() == 1 && g->storage.use_count() == 1 && !g->grad_fn &&
                       !g->requires_grad && !g->grad && !g->post_accumulate_grad;
    acc = alone ? std::move(g) : Tensor(g).clone().impl_ptr();
    return;
  }
  Tensor a(acc), more(std::move(g));
  const KernelTable& k = kernels_for(a.device());
  if (a.dtype() == DType::bf16) {  // added in float32, rounded to bf16 once (as PyTorch does)
    const Tensor sum = a.to_dtype(DType::f32), wm = more.to_dtype(DType::f32);
    k.binary(BinaryOp::add, sum.data(), sum.data(), wm.data(), a.numel(), 1, Broadcast::same);
    k.to_bf16(a.bf16_data(), sum.data(), a.numel());
    return;
  }
  k.binary(BinaryOp::add, a.data(), a.data(), more.data(), a.numel(), 1, Broadcast::same);
}

static void apply_planted_bug(const std::string& op, std::vector<Tensor>& grads) {
  using testing::Bug;
  if (testing::g_bug == Bug::none || op != testing::g_bug_op) return;
  for (size_t i = 0; i < grads.size(); i++) {
    Tensor& g = grads[i];
    if (!g.defined()) continue;
    const KernelTable& k = kernels_for(g.device());
    const bool half = g.dtype() == DType::bf16;  // planted in float32, rounded back to bf16
    const Tensor w = half ? g.to_dtype(DType::f32) : g.clone();
    if (testing::g_bug == Bug::flip_sign) k.affine(w.data(), w.data(), w.numel(), -1.f, 0.f);
    if (testing::g_bug == Bug::scale_by_1_01) k.affine(w.data(), w.data(), w.numel(), 1.01f, 0.f);
    if (testing::g_bug == Bug::drop_first_input && i == 0)
      k.fill(w.data(), w.numel(), 0.f);
    g = half ? w.to_dtype(DType::bf16) : w;
  }
}

void DeferredGrads::run() {
  while (run_next()) {
  }
}

bool DeferredGrads::run_next() {
  if (pending_.empty()) return false;
  NoGradGuard no_grad;
  std::function<void()> f = std::move(pending_.front());
  pending_.pop_front();
  f();
  return true;
}

namespace {

// A weight whose gradient a split op defers: the W's of this backward still to run for it, and
// whether every op that reads it has had its turn. Its hook fires when both are done.
struct PendingW {
  int ws = 0;
  bool edges_done = false;
};

// Checks a backward's gradient for input `i` of op `name` against the input's shape.
void check_grad_shape(const std::string& name, const char* what, size_t i, const Tensor& grad, const Tensor& input) {
  FF_CHECK(grad.shape() == input.shape(), what << name << ": gradient " << i << " has shape " << shape_str(grad.shape())
                                               << ", input has " << shape_str(input.shape()));
  FF_CHECK(grad.dtype() == input.dtype(), what << name << ": gradient " << i << " is " << dtype_name(grad.dtype())
                                               << ", input is " << dtype_name(input.dtype()));
}

// A split op's W, queued on DeferredGrads: the weights' gradients go into their .grad, and a
// weight whose last W this is, its readers all done, is finished (its hook fires, with or
// without a gradient). It keeps the weights and (through the op's captures) what their
// gradients need alive until it runs.
struct DeferredW {
  std::vector<std::shared_ptr<TensorImpl>> weights;
  std::vector<std::shared_ptr<PendingW>> waits;  // each weight's pending W's, this one among them
  std::vector<int> ws;                           // the weights' places among the op's inputs
  size_t n_inputs = 0;
  std::string name;
  std::function<std::vector<Tensor>()> fn;

  void operator()() const {
    std::vector<Tensor> w = fn();
    FF_CHECK(w.size() == ws.size(), "weight backward of " << name << " returned " << w.size() << " gradients for "
                                                           << ws.size() << " weights");
    std::vector<Tensor> grads(n_inputs);  // as the full backward returns them
    for (size_t k = 0; k < ws.size(); k++) grads[(size_t)ws[k]] = std::move(w[k]);
    apply_planted_bug(name, grads);
    for (size_t k = 0; k < ws.size(); k++) {
      Tensor& gk = grads[(size_t)ws[k]];
      if (gk.defined()) {
        check_grad_shape(name, "weight backward of ", (size_t)ws[k], gk, Tensor(weights[k]));
        std::shared_ptr<TensorImpl> handed = gk.impl_ptr();
        gk = Tensor();  // (handed is the only handle left)
        accumulate(weights[k]->grad, std::move(handed));
      }
      if (--waits[k]->ws == 0 && waits[k]->edges_done && weights[k]->post_accumulate_grad)
        weights[k]->post_accumulate_grad();
    }
  }
};

// One backward from one root, in named steps: the order, then each tensor's turn.
class BackwardPass {
 public:
  // deferred: where split ops' W's go (DeferredGrads' queue), or nullptr: every op whole
  BackwardPass(const Tensor& root, const Tensor& grad_output, std::deque<std::function<void()>>* deferred)
      : root_(root.impl()), deferred_(deferred) {
    grads_[root_] = grad_output.clone().impl_ptr();
  }

  // Topological order of the impls reachable from root through grad_fn (every tensor after its
  // inputs), counting for every leaf the edges into it (the ops that read it): its gradient is
  // final once they have all had their turn.
  std::vector<TensorImpl*> topological_order() {
    std::vector<TensorImpl*> order;
    std::unordered_set<TensorImpl*> seen{root_};
    std::vector<std::pair<TensorImpl*, size_t>> stack{{root_, 0}};
    while (!stack.empty()) {
      auto& [t, next] = stack.back();
      Node* node = t->grad_fn.get();
      if (node && next < node->inputs.size()) {
        TensorImpl* child = node->inputs[next++].impl();
        if (child && child->requires_grad) {
          if (!child->grad_fn) leaf_edges_[child]++;
          if (seen.insert(child).second) stack.push_back({child, 0});
        }
        continue;
      }
      order.push_back(t);
      stack.pop_back();
    }
    return order;
  }

  // Tensor t's turn in the reverse walk: its op's backward (the input gradients now, the weight
  // gradients deferred when the op splits and a DeferredGrads is given), its inputs' gradients
  // accumulated, its own freed, and every leaf it reads one edge closer to finished. Whether an
  // op's backward ran.
  bool visit(TensorImpl* t) {
    if (!t->grad_fn) {  // a leaf: finished by its readers (or the root itself, a lone leaf)
      if (t == root_) {
        accumulate(t->grad, grads_[t]);
        if (t->post_accumulate_grad) t->post_accumulate_grad();
      }
      return false;
    }
    Node* node = t->grad_fn.get();
    auto found = grads_.find(t);
    if (found == grads_.end()) {  // no gradient flowed here: its readers' edges are done all the same
      node_done(node);
      return false;
    }
    const Tensor g(found->second);
    std::vector<Tensor> in_grads = splits(*node) ? input_grads_deferring_weights(node, g) : node->backward(g);
    FF_CHECK(in_grads.size() == node->inputs.size(), "backward of " << node->name << " returned " << in_grads.size()
                                                                     << " gradients for " << node->inputs.size() << " inputs");
    apply_planted_bug(node->name, in_grads);
    for (size_t i = 0; i < in_grads.size(); i++) {
      const Tensor& in = node->inputs[i];
      if (!in.requires_grad() || !in_grads[i].defined()) continue;
      check_grad_shape(node->name, "backward of ", i, in_grads[i], in);
      std::shared_ptr<TensorImpl> handed = in_grads[i].impl_ptr();
      in_grads[i] = Tensor();
      accumulate(grads_[in.impl()], std::move(handed));
    }
    grads_.erase(t);  // free intermediate gradients as soon as they are consumed
    node_done(node);
    return true;
  }

 private:
  // A leaf is finished as soon as the last op that reads it has had its turn (whether or not
  // that op sent it a gradient): its gradient goes into .grad then, and its post_accumulate_grad
  // hook fires, without waiting for the leaf's own place in the order (which can be anywhere
  // after its readers). A weight with deferred W's pending: the last of them fires the hook.
  void edge_done(TensorImpl* leaf) {
    if (--leaf_edges_[leaf] > 0) return;
    auto found = grads_.find(leaf);
    if (found != grads_.end()) {
      accumulate(leaf->grad, std::move(found->second));
      grads_.erase(found);
    }
    auto p = pending_.find(leaf);
    if (p != pending_.end() && p->second->ws > 0) {
      p->second->edges_done = true;  // the last W fires the hook
      return;
    }
    if (leaf->post_accumulate_grad) leaf->post_accumulate_grad();
  }

  // every edge of a node into a leaf, once the node has had its turn
  void node_done(Node* node) {
    for (const Tensor& in : node->inputs)
      if (in.impl() && in.impl()->requires_grad && !in.impl()->grad_fn) edge_done(in.impl());
  }

  // The op's weight gradients can wait: a DeferredGrads to put them on, and every weight input
  // a leaf that wants a gradient.
  bool splits(const Node& node) const {
    if (!deferred_ || node.weight_inputs.empty()) return false;
    for (int w : node.weight_inputs) {
      const Tensor& weight = node.inputs[(size_t)w];
      if (!weight.requires_grad() || weight.impl()->grad_fn) return false;
    }
    return true;
  }

  // "I" now, "W" later: the op's input gradients, its weights' queued as a DeferredW.
  std::vector<Tensor> input_grads_deferring_weights(Node* node, const Tensor& g) {
    SplitGrads s = node->split_backward(g);
    DeferredW w;
    for (int i : node->weight_inputs) {
      TensorImpl* leaf = node->inputs[(size_t)i].impl();
      w.weights.push_back(node->inputs[(size_t)i].impl_ptr());
      std::shared_ptr<PendingW>& p = pending_[leaf];
      if (!p) p = std::make_shared<PendingW>();
      p->ws++;
      w.waits.push_back(p);
    }
    w.ws = node->weight_inputs, w.n_inputs = node->inputs.size(), w.name = node->name, w.fn = std::move(s.weights);
    deferred_->push_back(std::move(w));
    return std::move(s.inputs);
  }

  TensorImpl* root_;
  std::deque<std::function<void()>>* deferred_;
  std::unordered_map<TensorImpl*, int> leaf_edges_;
  std::unordered_map<TensorImpl*, std::shared_ptr<PendingW>> pending_;
  std::unordered_map<TensorImpl*, std::shared_ptr<TensorImpl>> grads_;
};

}  // namespace

void run_backward(const Tensor& root, const Tensor& grad_output, DeferredGrads* deferred,
                  const std::function<void()>& after_each_op) {
  FF_CHECK(root.requires_grad(), "backward() on a tensor that does not require grad");
  FF_CHECK(grad_output.shape() == root.shape(), "backward: gradient shape " << shape_str(grad_output.shape())
                                                    << " != tensor shape " << shape_str(root.shape()));
  NoGradGuard no_grad;  // gradients are computed with ops, but never recorded
  BackwardPass pass(root, grad_output, deferred ? &deferred->pending_ : nullptr);
  const std::vector<TensorImpl*> order = pass.topological_order();
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    if (!pass.visit(*it)) continue;
    if (after_each_op) after_each_op();
    if (g_between_ops) g_between_ops();
  }
}

}  // namespace ff
