// lessons/09_inference/speed.h — decode speed as seed 002 measures it: tokens per second per
// batch size, and how much of the memory bandwidth a step uses.
//
// A decode step reads every weight it uses once (for all B rows together) and every cached
// token of every sequence, and computes little on each byte: at small B its time is the
// time to read those bytes. So
//     bytes per step = the weights read (all but the embedding, whose B rows are read, and the
//                      routed experts, of which only those some row chose are read)
//                    + the caches read (every cached token, every layer)
//     utilisation    = bytes per step / step time / the bandwidth this machine reads memory at
// measured, like seed 002's "HBM BW util" (which passes 100% at batch 1: not every expert is
// read, as here). The read bandwidth is measured here too, with as many threads as the cpu
// device's kernels use: a sum over an array far larger than the caches, best of three.
#pragma once
#include <cstdint>
#include <vector>

#include "common/layers/model.h"
#include "common/lesson/lesson.h"
#include "lessons/09_inference/attention_cache.h"
#include "lessons/09_inference/int8.h"
#include "lessons/09_inference/options.h"

namespace ff::infer {

struct SpeedRow {
  int64_t batch = 0, steps = 0;
  double step_ms = 0, tokens_per_s = 0;
  double weight_bytes = 0, cache_bytes = 0;  // read per step, on average
  double gb_per_s = 0;                       // (weight + cache bytes) / step time
};

// Bytes per second this process reads from memory with `threads` threads (the cpu device's
// matmul threads: what the decode runs on), a sum over 256 MiB, best of 3.
double read_bandwidth(int threads);

// One process: for each batch size, the prompts (taken in turn) prefilled and `steps` decode
// steps timed.
// int8: the decode steps' FFNs and experts read these int8 weights (Decoder's int8 mode), and
// their bytes are counted as int8's.
std::vector<SpeedRow> decode_speed(const model::Config& c, const model::Params& p, const Setup& s, CacheKind kind,
                                   const std::vector<int64_t>& batches, int64_t steps, const Int8Model* int8);

// int8: the FFNs and experts read int8 (the attention's weights dequantized at load).
void print_speed(Lesson& L, const std::vector<SpeedRow>& rows, CacheKind kind, double bandwidth, int threads,
                 bool int8, bool bf16 = false);

// --csv: the lesson's one table, a kind per row: cache (bytes per token per layer), decode (a
// cache's timed steps), speed (a --speed batch size). Columns a kind does not use are empty.
extern const char* const kCsvHeader;

}  // namespace ff::infer
