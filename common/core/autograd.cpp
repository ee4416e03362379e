// common/core/autograd.cpp — the tape and the reverse walk (a topological sort, as in micrograd).
#include "common/core/autograd.h"

#include <algorithm>
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
  kernels_for(a.device()).binary(BinaryOp::add, a.data(), a.data(), more.data(), a.numel(), 1,
                                 Broadcast::same);
}

static void apply_planted_bug(const std::string& op, std::vector<Tensor>& grads) {
  using testing::Bug;
  if (testing::g_bug == Bug::none || op != testing::g_bug_op) return;
  for (size_t i = 0; i < grads.size(); i++) {
    Tensor& g = grads[i];
    if (!g.defined()) continue;
    g = g.clone();
    const KernelTable& k = kernels_for(g.device());
    if (testing::g_bug == Bug::flip_sign) k.affine(g.data(), g.data(), g.numel(), -1.f, 0.f);
    if (testing::g_bug == Bug::scale_by_1_01) k.affine(g.data(), g.data(), g.numel(), 1.01f, 0.f);
    if (testing::g_bug == Bug::drop_first_input && i == 0)
      k.fill(g.data(), g.numel(), 0.f);
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

void run_backward(const Tensor& root, const Tensor& grad_output, DeferredGrads* deferred,
                  const std::function<void()>& after_each_op) {
  FF_CHECK(root.requires_grad(), "backward() on a tensor that does not require grad");
  FF_CHECK(grad_output.shape() == root.shape(),
           "backward: gradient shape " << shape_str(grad_output.shape()) << " != tensor shape "
                                       << shape_str(root.shape()));
  NoGradGuard no_grad;  // gradients are computed with ops, but never recorded

  // Topological order of the impls reachable from root through grad_fn, and for every leaf the
  // number of edges into it (the ops that read it): its gradient is final once they have all
  // had their turn.
  std::vector<TensorImpl*> order;
  std::unordered_set<TensorImpl*> seen;
  std::unordered_map<TensorImpl*, int> leaf_edges;
  std::vector<std::pair<TensorImpl*, size_t>> stack{{root.impl(), 0}};
  seen.insert(root.impl());
  while (!stack.empty()) {
    auto& [t, next] = stack.back();
    Node* node = t->grad_fn.get();
    if (node && next < node->inputs.size()) {
      TensorImpl* child = node->inputs[next++].impl();
      if (child && child->requires_grad) {
        if (!child->grad_fn) leaf_edges[child]++;
        if (!seen.count(child)) {
          seen.insert(child);
          stack.push_back({child, 0});
        }
      }
      continue;
    }
    order.push_back(t);
    stack.pop_back();
  }

  // Reverse walk: order has every tensor after its inputs. A leaf is finished as soon as the
  // last op that reads it has had its turn (whether or not that op sent it a gradient): its
  // gradient goes into .grad then, and its post_accumulate_grad hook fires, without waiting for
  // the leaf's own place in the order (which can be anywhere after its readers). A weight whose
  // gradient a split op defers has W's pending: its hook fires when the last of them has run
  // (after its readers' edges are all done, and its other gradients are in .grad).
  struct Pending {
    int ws = 0;               // deferred W's of this backward still to run for the leaf
    bool edges_done = false;  // every reader had its turn
  };
  std::unordered_map<TensorImpl*, std::shared_ptr<Pending>> pending;
  std::unordered_map<TensorImpl*, std::shared_ptr<TensorImpl>> grads;
  grads[root.impl()] = grad_output.clone().impl_ptr();
  const auto edge_done = [&](TensorImpl* leaf) {
    if (--leaf_edges[leaf] > 0) return;
    auto found = grads.find(leaf);
    if (found != grads.end()) {
      accumulate(leaf->grad, std::move(found->second));
      grads.erase(found);
    }
    auto p = pending.find(leaf);
    if (p != pending.end() && p->second->ws > 0) {
      p->second->edges_done = true;  // the last W fires the hook
      return;
    }
    if (leaf->post_accumulate_grad) leaf->post_accumulate_grad();
  };
  // every edge of a node into a leaf, once the node has had its turn
  const auto node_done = [&](Node* node) {
    for (size_t i = 0; i < node->inputs.size(); i++) {
      TensorImpl* in = node->inputs[i].impl();
      if (in && in->requires_grad && !in->grad_fn) edge_done(in);
    }
  };
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    TensorImpl* t = *it;
    if (!t->grad_fn) {  // a leaf: finished by its readers (or the root itself, a lone leaf)
      if (t == root.impl()) {
        accumulate(t->grad, grads[t]);
        if (t->post_accumulate_grad) t->post_accumulate_grad();
      }
      continue;
    }
    auto found = grads.find(t);
    if (found == grads.end()) {  // no gradient flowed here: its readers' edges are done all the same
      node_done(t->grad_fn.get());
      continue;
    }
    Tensor g(found->second);
    Node* node = t->grad_fn.get();
    std::vector<Tensor> in_grads;
    bool split = deferred && !node->weight_inputs.empty();
    for (int w : node->weight_inputs) {
      const Tensor& weight = node->inputs[(size_t)w];
      split = split && weight.requires_grad() && !weight.impl()->grad_fn;
    }
    if (split) {
      // "I" now, "W" later: the closure keeps the weights and (through the op's captures)
      // what their gradients need alive until it runs.
      SplitGrads s = node->split_backward(g);
      in_grads = std::move(s.inputs);
      std::vector<std::shared_ptr<TensorImpl>> weights;
      std::vector<std::shared_ptr<Pending>> waits;  // each weight's pending W's, this one among them
      for (int w : node->weight_inputs) {
        TensorImpl* leaf = node->inputs[(size_t)w].impl();
        weights.push_back(node->inputs[(size_t)w].impl_ptr());
        std::shared_ptr<Pending>& p = pending[leaf];
        if (!p) p = std::make_shared<Pending>();
        p->ws++;
        waits.push_back(p);
      }
      deferred->pending_.push_back([weights, waits, ws = node->weight_inputs, n_inputs = node->inputs.size(),
                                    name = node->name, fn = std::move(s.weights)] {
        std::vector<Tensor> w = fn();
        FF_CHECK(w.size() == ws.size(), "weight backward of " << name << " returned " << w.size()
                                            << " gradients for " << ws.size() << " weights");
        std::vector<Tensor> grads(n_inputs);  // as the full backward returns them
        for (size_t k = 0; k < ws.size(); k++) grads[(size_t)ws[k]] = std::move(w[k]);
        apply_planted_bug(name, grads);
        for (size_t k = 0; k < ws.size(); k++) {
          const Tensor& gk = grads[(size_t)ws[k]];
          if (gk.defined()) {
            FF_CHECK(gk.shape() == Tensor(weights[k]).shape(),
                     "weight backward of " << name << ": gradient " << ws[k] << " has shape "
                                           << shape_str(gk.shape()) << ", input has "
                                           << shape_str(Tensor(weights[k]).shape()));
            std::shared_ptr<TensorImpl> handed = gk.impl_ptr();
            grads[(size_t)ws[k]] = Tensor();  // (gk refers to it: not used past here)
            accumulate(weights[k]->grad, std::move(handed));
          }
          // the leaf's last W, its readers all done: finished (with or without a gradient)
          if (--waits[k]->ws == 0 && waits[k]->edges_done && weights[k]->post_accumulate_grad)
            weights[k]->post_accumulate_grad();
        }
      });
    } else {
      in_grads = node->backward(g);
    }
    FF_CHECK(in_grads.size() == node->inputs.size(),
             "backward of " << node->name << " returned " << in_grads.size() << " gradients for "
                            << node->inputs.size() << " inputs");
    apply_planted_bug(node->name, in_grads);
    for (size_t i = 0; i < in_grads.size(); i++) {
      const Tensor& in = node->inputs[i];
      if (!in.requires_grad() || !in_grads[i].defined()) continue;
      FF_CHECK(in_grads[i].shape() == in.shape(),
               "backward of " << node->name << ": gradient " << i << " has shape "
                              << shape_str(in_grads[i].shape()) << ", input has "
                              << shape_str(in.shape()));
      std::shared_ptr<TensorImpl> handed = in_grads[i].impl_ptr();
      in_grads[i] = Tensor();
      accumulate(grads[in.impl()], std::move(handed));
    }
    grads.erase(t);  // free intermediate gradients as soon as they are consumed
    node_done(node);
    if (after_each_op) after_each_op();
    if (g_between_ops) g_between_ops();
  }
}

}  // namespace ff
