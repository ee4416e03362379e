// lessons/09_inference/options.h — lesson 09's flags and every check of them, before any work
// (one error: line, exit 2 on every rank).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/layers/model.h"
#include "common/lesson/corpus.h"
#include "common/lesson/lesson.h"
#include "lessons/09_inference/attention_cache.h"
#include "lessons/09_inference/moe_decode.h"

namespace ff::infer {

struct Options {
  int64_t batch = 4, new_tokens = 48, val_batches = 4, ranks_per_node = 0;
  bool int8 = false, bf16 = false;
  int64_t dim = 64, layers = 3, dense_layers = 1, heads = 4, d_nope = 16, d_rope = 8, d_v = 16;
  int64_t q_lora = 32, kv_lora = 32, ffn = 128, experts = 8, topk = 2, shared = 1, moe_ffn = 32;
  std::string prompts = "ROMEO:|JULIET:|First Citizen:|KING RICHARD III:", cache = "all", bug = "none",
              moe_comm = "alltoall", checkpoint, data, speed, link;
};

// What the flags decide, every check passed.
struct Setup {
  model::Config c;
  CharCorpus corpus;                         // the vocabulary (--data)
  std::vector<std::vector<int64_t>> prompts; // B of them, encoded
  std::vector<CacheKind> kinds;              // the caches to run (--cache)
  Bug bug = Bug::none;
  MoeComm moe_comm = MoeComm::alltoall;
  bool int8_per_tensor = false;              // --bug int8-per-tensor
  bool bf16 = false;                         // --bf16: the matmuls' weights in bf16
  int64_t capacity = 0;                      // tokens per sequence: longest prompt + --new
  std::vector<int64_t> speed_batches;        // --speed
  LinkModel link;                            // --link (off when not given)
};

Setup parse_options(Lesson& lesson, Options& opts);

}  // namespace ff::infer
