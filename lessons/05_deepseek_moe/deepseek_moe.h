// lessons/05_deepseek_moe/deepseek_moe.h — what the lesson's files share: the expert-parallel
// layer (common/layers/dsv3_ep.h) that the check (main.cpp) and the training demo (train.cpp)
// run, and the flags (options.cpp).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/layers/dsv3_ep.h"
#include "common/layers/dsv3_moe.h"
#include "common/util/files.h"
#include "common/lesson/lesson.h"

namespace ff::deepseek {

// The distributed layer (common/layers/dsv3_ep.h), under the names this lesson uses.
using dsv3::allgather_vec;
using dsv3::ep_backward;
using dsv3::ep_forward;
using dsv3::EPForward;
using dsv3::make_topology;
using dsv3::RoutingMap;
using dsv3::Scheme;
using dsv3::Topology;

// The training demo (train.cpp): --train STEPS.
struct TrainOptions {
  int64_t steps = 0, batch = 2, log_every = 10;
  std::string balance = "bias";  // none | aux | bias
  std::string bug = "none";      // none | ema-zero-init | bias-peek
  double lr = 3e-3, gamma = 0.01, aux_alpha = 0.01, ema = 0.0;
  // with --balance bias: DeepSeek-V3's complementary sequence-wise balance loss, whose weight
  // its training sets "to an extremely small value" (alpha = 0.0001, report §4.2)
  double seq_alpha = 0.0001;
  std::string data = course_data_file("tinyshakespeare.txt");  // found from the executable
};
int run_training(Lesson& lesson, Topology& topo, Scheme scheme, dsv3::Config config,
                 const TrainOptions& options);

// The group-limited selection checked by its definition, not by the kernel that made it (the
// one-process reference routes with the same kernel): every token's K experts are distinct and
// lie in its M kept groups, which are distinct; no other group outscores a kept one (a group's
// score: the sum of its group_score_k() best s + b, in double); and no unchosen expert of a
// kept group outscores a chosen one by s + b — both within 1e-5 relative, as the kernel
// compares float sums and breaks ties by index (routing_check.cpp).
bool routing_is_group_limited(const dsv3::Config& c, const Tensor& s, const Tensor& bias,
                              const dsv3::Selection& sel);
// That check, under its own heading of the lesson's report.
void check_selection(Lesson& lesson, CheckReport& check, const dsv3::Config& c, const Tensor& s,
                     const Tensor& bias, const dsv3::Selection& sel);

// Lesson 05's flags, their defaults and where they land.
struct Flags {
  dsv3::Config c = default_config();
  int64_t batch = 2, R = 2, reps = 5;
  double bias_init = 0.05;
  std::string gate = "sigmoid", a2a = "hierarchical", overflow = "drop", bug = "none", link_spec,
              aux_count = "unbiased-topk";
  TrainOptions train;
  static dsv3::Config default_config() {
    dsv3::Config c;
    c.experts = 16, c.topk = 4, c.shared = 1, c.groups = 0, c.topk_groups = 2;
    c.route_scale = 2.5, c.alpha = 0.01;
    return c;
  }
};
// Declares every flag on cli, writing into f (options.cpp).
void declare_flags(Cli& cli, Flags* f);

}  // namespace ff::deepseek
