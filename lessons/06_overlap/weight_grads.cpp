// lessons/06_overlap/weight_grads.cpp — the weight gradients set aside and their sums
// (weight_grads.h).
#include "lessons/06_overlap/weight_grads.h"


namespace ff::f1b {

double WeightGrads::run_next() {
  NoGradGuard no_grad;
  if (moe_next_ < moe_.size()) {
    auto item = std::move(moe_[moe_next_++]);
    item.second();
    return item.first;
  }
  attention.run_next();
  return flops_.attention_weight_grad();
}

void WeightGrads::add_shared(const moe::ExpertGrads& shared, const dsv3::Params& full) {
  accumulate(sums.sw1, reshape(shared.dw1, full.sw1.shape()));
  accumulate(sums.sw2, reshape(shared.dw2, full.sw2.shape()));
  accumulate(sums.sw3, reshape(shared.dw3, full.sw3.shape()));
}

void WeightGrads::add_expert(const moe::ExpertGrads& expert, int64_t e) {
  auto into = [&](Tensor& sum, const Tensor& t) {
    // [exercise:add-expert] Add local expert e's weight gradient t (one expert's) into sum, the rank's (local experts, ...) stack, starting it at zeros.
    if (!sum.defined()) {
      Shape shape = t.shape();
      shape[0] = setup_.moe.experts / ranks_;
      sum = Tensor::zeros(shape, setup_.dev);
    }
    const int64_t local_experts = sum.size(0);
    std::vector<Tensor> pieces;
    if (e > 0) pieces.push_back(slice(sum, 0, 0, e));
    pieces.push_back(add(slice(sum, 0, e, e + 1), t));
    if (e + 1 < local_experts) pieces.push_back(slice(sum, 0, e + 1, local_experts));
    sum = concat(pieces, 0);
    // [/exercise]
  };
  into(sums.w1, expert.dw1), into(sums.w2, expert.dw2), into(sums.w3, expert.dw3);
}

}  // namespace ff::f1b
