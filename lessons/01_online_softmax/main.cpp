// Lesson 01 — online softmax: one pass over a row, then over many ranks.
//
// What: softmax(x)_j = exp(x_j) / sum_k exp(x_k), computed three ways.
//   [1] single process: the safe two-pass softmax (max first, then the sum) against the
//       one-pass online softmax, which keeps a running max m and normaliser l and
//       rescales the past, l * exp(m_old - m_new), whenever the max grows
//       (Milakov & Gimelshein, "Online normalizer calculation for softmax", 2018).
//   [2] distributed: the columns of every row are split over P ranks. Each rank folds its
//       columns into a local (m, l); the P states are merged (a) along a chain, as in the
//       lecture notes, and (b) with one MPI_Allreduce, because the merge is associative
//       and commutative.
//   [3] the bridge to attention: the state (m, l, o), with o the running softmax-weighted
//       sum of values, gives split-K "flash-decoding" of queries over keys and values
//       sharded across ranks (Dao et al., "Flash-Decoding for long-context inference", 2023).
// Why: every later lesson (ring attention, FlashAttention tiles, context parallelism) is
//   this merge applied to blocks of a sequence.
//   With --device sim or cuda, the same three steps run as CUDA kernels
//   (online_softmax.cu: one warp per row merging (m, l) with __shfl_xor_sync; split-K
//   flash-decoding in two kernels) — on the GPU, or on the CPU through the SIMT emulator.
// Run:  make run L=01 NP=4
//       make run L=01 NP=4 ARGS="--rows 8 --cols 1000 --block 64"
//       make run L=01 NP=4 ARGS="--device sim"
// Expect: three sections, each comparison against the single-process softmax printed with
//   max abs / max rel error and its tolerance, the chain and allreduce timings, and
//   "check: PASS". `--bug no-rescale` or `--bug no-inf-guard` plants the two classic
//   mistakes; the check then reports FAIL and the program exits 1.
#include <mpi.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "common/lesson/lesson.h"
#include "lessons/01_online_softmax/lesson_kernels.h"

using namespace ff;
using namespace ff::online_softmax;


static const float kNegInf = -std::numeric_limits<float>::infinity();

// Which classic mistake to plant (--bug), to see the checks fail.
enum class Bug { none, no_rescale, no_inf_guard };
static Bug g_bug = Bug::none;

// ----------------------------------------------------------------------------
// The online softmax state and its two operations.

// [slide:state]
// The running max m of the values seen so far, and l = sum over them of exp(x - m).
// The empty state is (m = -inf, l = 0): the identity of merge().
struct SoftmaxState {
  float m = kNegInf;
  float l = 0.f;
};

// exp(a - b) for a <= b, where a = -inf means "nothing seen": contributes 0.
// Without the guard, -inf - (-inf) = NaN poisons l as soon as a block is all -inf.
static float rescale(float a, float b) {
  if (g_bug != Bug::no_inf_guard && a == kNegInf) return 0.f;
  return std::exp(a - b);
}
// [/slide]

// [slide:fold-block]
// Folds a block of values into the state: one pass over the block.
static SoftmaxState fold_block(SoftmaxState s, const float* x, int64_t n) {
  float m_new = s.m;
  for (int64_t j = 0; j < n; j++) m_new = std::max(m_new, x[j]);
  // The old sum was taken relative to the old max: rescale it to the new one.
  float l = (g_bug == Bug::no_rescale) ? s.l : s.l * rescale(s.m, m_new);
  for (int64_t j = 0; j < n; j++) l += rescale(x[j], m_new);
  return {m_new, l};
}
// [/slide]

// [slide:merge]
// Merges two states: the same rescaling, applied to both sides.
static SoftmaxState merge(SoftmaxState a, SoftmaxState b) {
  if (g_bug == Bug::no_rescale) return {std::max(a.m, b.m), a.l + b.l};
  // [exercise:merge] Merge two partial states (m, l) of one row into the state of both.
  const float m = std::max(a.m, b.m);
  return {m, a.l * rescale(a.m, m) + b.l * rescale(b.m, m)};
  // [/exercise]
}
// [/slide]

// One row in blocks of `block` columns (the last block may be shorter).
static SoftmaxState fold_row(const float* x, int64_t n, int64_t block) {
  SoftmaxState s;
  for (int64_t j = 0; j < n; j += block) s = fold_block(s, x + j, std::min(block, n - j));
  return s;
}

// y = exp(x - m) / l with the row's final state: the only second pass, and only to write.
static void normalise(float* y, const float* x, int64_t n, SoftmaxState s) {
  for (int64_t j = 0; j < n; j++) y[j] = rescale(x[j], s.m) / s.l;
}

// [slide:two-pass]
// The safe two-pass softmax, written out: pass 1 finds the max, pass 2 sums.
static void two_pass_softmax(float* y, const float* x, int64_t n) {
  float m = kNegInf;
  for (int64_t j = 0; j < n; j++) m = std::max(m, x[j]);
  float l = 0.f;
  for (int64_t j = 0; j < n; j++) l += std::exp(x[j] - m);
  for (int64_t j = 0; j < n; j++) y[j] = std::exp(x[j] - m) / l;
}
// [/slide]

// ----------------------------------------------------------------------------
// The same algorithm as CUDA kernels (online_softmax.cu, lesson_kernels.h), for --device sim or
// cuda. The (m, l) of every row of x (rows, n), by the row_states kernel on x's device.
static std::vector<SoftmaxState> device_row_states(const Tensor& x) {
  const int64_t rows = x.size(0), n = x.size(1);
  Tensor state = Tensor::empty({rows, 2}, x.device());
  lesson_kernels(x.device()).row_states(state.data(), x.data(), rows, n);
  std::vector<float> h = state.to_vector();  // stage through the host
  std::vector<SoftmaxState> out((size_t)rows);
  for (int64_t r = 0; r < rows; r++) out[(size_t)r] = {h[(size_t)(2 * r)], h[(size_t)(2 * r + 1)]};
  return out;
}

// y = exp(x - m) / l on x's device, with the states of the rows.
static Tensor device_normalise(const Tensor& x, const std::vector<SoftmaxState>& states) {
  const int64_t rows = x.size(0), n = x.size(1);
  std::vector<float> h;
  for (const SoftmaxState& st : states) h.insert(h.end(), {st.m, st.l});
  Tensor state = Tensor::from_vector(h, {rows, 2}).to(x.device());
  Tensor y = Tensor::empty({rows, n}, x.device());
  lesson_kernels(x.device()).normalise(y.data(), x.data(), state.data(), rows, n);
  return y.to(Device::cpu);
}

// ----------------------------------------------------------------------------
// Inputs. Every rank generates exactly its own columns of the same global x (the
// counter-based RNG makes the slices bit-identical to the whole), then applies the
// two stress cases by global column index:
//   row 1 is scaled x1000 (exp overflows without the max subtraction);
//   row 2 starts with a whole block of -inf (a masked prefix), when the row is longer.

static Tensor make_x(int64_t rows, int64_t cols, int64_t c0, int64_t c1, int64_t block,
                     uint64_t seed) {
  Tensor x = randn_slice({rows, cols}, 1, c0, c1, seed);
  float* p = x.data();
  int64_t w = c1 - c0;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t j = 0; j < w; j++) {
      if (r == 1) p[r * w + j] *= 1000.f;
      if (r == 2 && cols > block && c0 + j < block) p[r * w + j] = kNegInf;
    }
  return x;
}

// ----------------------------------------------------------------------------
// Distributed merges of one (m, l) per row.

// (a) The chain: rank r waits for the merged state of ranks 0..r-1, folds in its own
// and passes it on; the last rank holds the answer and broadcasts it. P-1 sequential
// hops plus a broadcast: O(P) latency.
// [slide:chain]
static std::vector<SoftmaxState> chain_merge(Comm& comm, std::vector<SoftmaxState> local) {
  const int r = comm.rank(), P = comm.size();
  const size_t bytes = local.size() * sizeof(SoftmaxState);
  std::vector<SoftmaxState> acc = local;
  if (r > 0) {
    std::vector<SoftmaxState> prev(local.size());
    comm.recv(prev.data(), bytes, r - 1, /*tag=*/1);
    for (size_t i = 0; i < acc.size(); i++) acc[i] = merge(prev[i], local[i]);
  }
  if (r < P - 1) comm.send(acc.data(), bytes, r + 1, /*tag=*/1);
  comm.bcast(acc.data(), bytes, P - 1);
  return acc;
}
// [/slide]

// [slide:merge-op]
// (b) One MPI_Allreduce with a user-defined reduction. MPI may combine the states in
// any order and grouping (a tree, a ring, recursive doubling): that is allowed because
// merge() is associative and commutative. O(log P) latency.
static void merge_op(void* in, void* inout, int* len, MPI_Datatype*) {
  // [exercise:merge-op] MPI's reduction op: fold the *len states at `in` into those at `inout`.
  auto* a = static_cast<SoftmaxState*>(in);
  auto* b = static_cast<SoftmaxState*>(inout);
  for (int i = 0; i < *len; i++) b[i] = merge(a[i], b[i]);
  // [/exercise]
}
// [/slide]

static std::vector<SoftmaxState> allreduce_merge(Comm& comm, std::vector<SoftmaxState> local,
                                                 MPI_Datatype state_type, MPI_Op op) {
  comm.allreduce(local.data(), (int)local.size(), state_type, op);
  return local;
}

// ----------------------------------------------------------------------------
// [slide:mlo-merge]
// [3] Flash-decoding state: (m, l, o[dv]) per query. o is the sum over keys of
// exp(s - m) * v, so the merge rescales o exactly as it rescales l.

static void merge_mlo(const float* a, float* b, int64_t dv) {
  float m = std::max(a[0], b[0]);
  float fa = rescale(a[0], m), fb = rescale(b[0], m);
  if (g_bug == Bug::no_rescale) fa = fb = 1.f;
  b[0] = m;
  b[1] = a[1] * fa + b[1] * fb;
  for (int64_t k = 0; k < dv; k++) b[2 + k] = a[2 + k] * fa + b[2 + k] * fb;
}
// [/slide]

// The datatype is (2 + dv) floats; MPI passes it to the op, so dv comes from its size.
static void merge_mlo_op(void* in, void* inout, int* len, MPI_Datatype* type) {
  int bytes = 0;
  MPI_Type_size(*type, &bytes);
  int64_t width = bytes / (int64_t)sizeof(float), dv = width - 2;
  for (int i = 0; i < *len; i++)
    merge_mlo(static_cast<float*>(in) + i * width, static_cast<float*>(inout) + i * width, dv);
}

// ----------------------------------------------------------------------------

// The lesson: its flags, [1]-[3], the check and the outputs. The skeleton (run_lesson,
// common/lesson/lesson.h) owns MPI, the shared flags, bad input and the writes.
// This rank's flash-decoding state for every query: the scores s = k.q * scale over its keys,
// (m, l) over them and o = sum exp(s - m) v, one (2 + dv) row per query: by the CUDA kernels of
// online_softmax.cu on sim or cuda, else by the online recurrence on the host.
static std::vector<float> local_decode_state(const Tensor& q, const Tensor& k_local,
                                             const Tensor& v_local, int64_t block, Device dev) {
  const int64_t nq = q.size(0), d = q.size(1), dv = v_local.size(1), nk = k_local.size(0);
  const float scale = 1.f / std::sqrt((float)d);
  const int64_t width = 2 + dv;
  std::vector<float> mlo((size_t)(nq * width));
  if (dev != Device::cpu) {
    // On the device: scores with the library's matmul kernel, then flash-decoding's two
    // kernels: each chunk of ~kKeysPerChunk keys folded into (m, l, o) by its own block,
    // then the chunks merged. The rank's state goes to the host for MPI.
    Trace::Scope span(trace(), "local attention on device", "compute");
    constexpr int64_t kKeysPerChunk = 128;
    const int64_t splits = std::max<int64_t>(1, (nk + kKeysPerChunk - 1) / kKeysPerChunk);
    Tensor s = scale * matmul(q.to(dev), transpose(k_local.to(dev), 0, 1));  // (nq, nk)
    Tensor vd = v_local.to(dev);
    Tensor partial = Tensor::empty({nq, splits, width}, dev), state = Tensor::empty({nq, width}, dev);
    const LessonKernels kern = lesson_kernels(dev);
    kern.decode_partial(partial.data(), s.data(), vd.data(), nq, nk, dv, splits);
    kern.merge_states(state.data(), partial.data(), nq, dv, splits);
    mlo = state.to_vector();
  } else {
    Trace::Scope span(trace(), "local attention", "compute");
    for (int64_t i = 0; i < nq; i++) {
      float* st = &mlo[(size_t)(i * width)];
      std::vector<float> s((size_t)(nk));
      for (int64_t t = 0; t < nk; t++) {
        float acc = 0.f;
        for (int64_t c = 0; c < d; c++) acc += q.data()[i * d + c] * k_local.data()[t * d + c];
        s[(size_t)t] = acc * scale;
      }
      SoftmaxState ml = fold_row(s.data(), (int64_t)s.size(), block);
      st[0] = ml.m;
      st[1] = ml.l;
      for (int64_t c = 0; c < dv; c++) st[2 + c] = 0.f;
      for (int64_t t = 0; t < nk; t++) {
        float p = rescale(s[(size_t)t], ml.m);
        for (int64_t c = 0; c < dv; c++) st[2 + c] += p * v_local.data()[t * dv + c];
      }
    }
  }
  return mlo;
}

// Long format, appended (make plots runs the lesson at several P into one file):
//   series chain_us / allreduce_us: x = P, y = median merge time (min and max beside it)
//   series chain_steps / allreduce_steps: x = P, y = sequential merge steps (exact)
//   series fold_m / fold_l: x = columns folded so far, y = m / l of row 0, block by block
static std::string csv_rows(int P, const Tensor& x, int64_t block, const RepTimes& chain_us,
                            const RepTimes& allreduce_us, int log2P) {
  const int64_t rows = x.size(0), cols = x.size(1);
  std::string csv;
  auto row = [&](const char* series, double xv, double yv, double lo, double hi) {
    char line[160];
    std::snprintf(line, sizeof line, "%d,%lld,%lld,%lld,%s,%g,%.9g,%.9g,%.9g\n", P, (long long)rows,
                  (long long)cols, (long long)block, series, xv, yv, lo, hi);
    csv += line;
  };
  row("chain_us", P, chain_us.median, chain_us.min, chain_us.max);
  row("allreduce_us", P, allreduce_us.median, allreduce_us.min, allreduce_us.max);
  row("chain_steps", P, P - 1 + log2P, P - 1 + log2P, P - 1 + log2P);
  row("allreduce_steps", P, log2P, log2P, log2P);
  SoftmaxState s;
  for (int64_t j = 0; j < cols; j += block) {
    s = fold_block(s, x.data() + j, std::min(block, cols - j));
    row("fold_m", (double)std::min(j + block, cols), s.m, s.m, s.m);
    row("fold_l", (double)std::min(j + block, cols), s.l, s.l, s.l);
  }
  return csv;
}

// What runs: the sizes and the device.
static void print_intro(const Lesson& lesson, const Tensor& x, int64_t block) {
  const int64_t rows = x.size(0), cols = x.size(1);
  const Device dev = lesson.device;
  lesson.print("== 01 online softmax: P=%d ranks, x is (%lld, %lld), blocks of %lld columns\n",
               lesson.size(), (long long)rows, (long long)cols, (long long)block);
  if (dev != Device::cpu)
    lesson.print("   device %s: [1]-[3] also run as CUDA kernels (online_softmax.cu)%s\n",
                 device_name(dev), dev == Device::sim ? ", executed by the SIMT emulator" : "");
}

// --dump: every rank's (m, l) per row; rank 0 adds x, its softmax (probabilities), and q, K, V
// and the attention.
static void dump_outputs(Lesson& lesson, const std::vector<SoftmaxState>& local, const Tensor& x,
                         const Tensor& probabilities, const Tensor& q, const Tensor& K, const Tensor& V,
                         const Tensor& attention) {
  const int64_t rows = x.size(0);
  Tensor ml = Tensor::empty({rows, 2});
  for (int64_t r = 0; r < rows; r++) {
    ml.data()[2 * r] = local[(size_t)r].m;
    ml.data()[2 * r + 1] = local[(size_t)r].l;
  }
  lesson.dump("ml_rank" + std::to_string(lesson.rank()), ml);
  if (lesson.rank() == 0) {
    lesson.dump("x", x);
    lesson.dump("softmax", probabilities);
    lesson.dump("q", q);
    lesson.dump("k", K);
    lesson.dump("v", V);
    lesson.dump("attention", attention);
  }
}

// [1]'s checks: the two-pass softmax written out, and the online recurrence at block sizes 1,
// --block and the whole row, against the library's softmax; on sim or cuda also the kernels of
// online_softmax.cu and the library's own softmax kernel.
static void single_process_checks(CheckReport& check, const Tensor& x, const Tensor& reference,
                                  int64_t block, Device dev, double atol_x, double rtol_x) {
  const int64_t rows = x.size(0), cols = x.size(1);
  {
    Trace::Scope span(trace(), "single-process", "compute");
    Tensor two_pass = Tensor::empty({rows, cols});
    for (int64_t r = 0; r < rows; r++)
      two_pass_softmax(two_pass.data() + r * cols, x.data() + r * cols, cols);
    check.close("two-pass (written out) vs library softmax", two_pass, reference, atol_x, rtol_x);
    for (int64_t b : {int64_t(1), block, cols}) {
      Tensor online = Tensor::empty({rows, cols});
      for (int64_t r = 0; r < rows; r++) {
        SoftmaxState s = fold_row(x.data() + r * cols, cols, b);
        normalise(online.data() + r * cols, x.data() + r * cols, cols, s);
      }
      std::string what = "online, block " + std::to_string(b) +
                         (cols % b ? " (ragged last)" : "") + " vs library";
      check.close(what.c_str(), online, reference, atol_x, rtol_x);
    }
  }
  if (dev != Device::cpu) {
    // The kernels: (m, l) per row from 32 lanes merged by shuffles, then y = exp(x - m) / l.
    // And the library's own softmax kernel on the device (kernels/cuda/softmax.cu).
    Trace::Scope span(trace(), "single-process on device", "compute");
    Tensor xd = x.to(dev);
    Tensor y_kernel = device_normalise(xd, device_row_states(xd));
    std::string what = std::string("row_states kernel (") + device_name(dev) + ") vs library";
    check.close(what.c_str(), y_kernel, reference, atol_x, rtol_x);
    what = std::string("library softmax on ") + device_name(dev) + " vs cpu";
    check.close(what.c_str(), softmax(xd).to(Device::cpu), reference, atol_x, rtol_x);
  }
}

static int online_softmax_lesson(Lesson& lesson) {
  Comm& comm = lesson.comm;
  const int rank = comm.rank(), P = comm.size();
  int64_t rows = 4, cols = 1000, block = 64, keys = 1024, dim = 64, reps = 20;
  std::string bug = "none";
  Cli& cli = lesson.cli;
  cli.summary("Online softmax: the one-pass (m, l) recurrence, merged across ranks by a chain and\n"
              "by MPI_Allreduce with a user-defined op, and split-K flash-decoding with (m, l, o).");
  cli.flag("--rows", &rows, "rows of x (independent softmaxes; also decoding queries)", 1, 4096);
  cli.flag("--cols", &cols, "columns of x, split over the ranks (need not divide)", 1, 1 << 22);
  cli.flag("--block", &block, "columns folded per online step (last block may be shorter)", 1,
           1 << 22);
  cli.flag("--keys", &keys, "[3] keys/values, split over the ranks", 1, 1 << 20);
  cli.flag("--dim", &dim, "[3] head dimension of q, k, v", 1, 1024);
  cli.flag("--reps", &reps, "timed repetitions of each merge (median reported)", 1, 100000);
  cli.choice("--bug", &bug, {"none", "no-rescale", "no-inf-guard"},
             "plant a classic mistake to watch the check fail");
  cli.epilog("run:  make run L=01 NP=4 ARGS=\"--rows 8 --cols 1000\"\n"
             "      make run L=01 NP=4 ARGS=\"--device sim\"");
  lesson.parse();
  // Every rank holds x whole (the reference) and a few copies of it (two-pass, online per
  // block size, two gathered results), K and V whole and its slices, and the decode scores.
  lesson.require_memory(4.0 * (8.0 * rows * cols + 4.0 * keys * dim + 2.0 * rows * keys),
                        "--rows, --cols or --keys, --dim");
  const Device dev = lesson.device;
  const bool on_device = dev != Device::cpu;  // run the CUDA kernels of online_softmax.cu
  g_bug = bug == "no-rescale" ? Bug::no_rescale : bug == "no-inf-guard" ? Bug::no_inf_guard
                                                                         : Bug::none;
  lesson.start_trace();

  CheckReport check(comm);
  // Tolerances. Both sides compute exp of the same arguments (the max is exact), so
  // they differ only in how the normaliser l was summed: n float32 additions in a
  // different order, each off by at most eps/2 relative, bound the difference by
  // n * FLT_EPSILON / 2 relative (Higham, Accuracy and Stability, §4.2).
  const double rtol_x = (double)cols * FLT_EPSILON / 2;
  const double atol_x = 1e-30;  // softmax outputs are compared relatively

  // ---------------- [1] single process
  Tensor x = make_x(rows, cols, 0, cols, block, (uint64_t)lesson.flags.seed);
  Tensor reference = softmax(x);  // the library's safe softmax (kernels/cpu/reduce.cpp)
  print_intro(lesson, x, block);
  lesson.print("[1] single process: safe two-pass softmax vs one-pass online softmax\n");
  if (rows > 1) {  // every rank holds x: the naive sum is one row's pass
    double naive_l = 0;
    for (int64_t j = 0; j < cols; j++) naive_l += std::exp((float)x.data()[cols + j]);
    lesson.print("    row 1 is x1000: naive sum of exp(x) = %g, the max subtraction avoids it\n",
                 naive_l);
  }
  if (rows > 2 && cols > block)
    lesson.print("    row 2 starts with %lld columns of -inf (a masked prefix)\n", (long long)block);
  single_process_checks(check, x, reference, block, dev, atol_x, rtol_x);

  // ---------------- [2] distributed over columns
  int64_t col0, col1;
  split_range(cols, P, rank, &col0, &col1);
  const int64_t my_cols = col1 - col0;
  Tensor x_mine = make_x(rows, cols, col0, col1, block, (uint64_t)lesson.flags.seed);
  std::vector<SoftmaxState> local((size_t)rows);
  {
    Trace::Scope span(trace(), "fold local columns", "compute");
    if (on_device)
      local = device_row_states(x_mine.to(dev));
    else
      for (int64_t r = 0; r < rows; r++)
        local[(size_t)r] = fold_row(x_mine.data() + r * my_cols, my_cols, block);
  }
  const long long fewest = cols / P, most = (cols + P - 1) / P;
  const std::string each =
      fewest == most ? std::to_string(fewest) : std::to_string(fewest) + " or " + std::to_string(most);
  lesson.print("[2] distributed: rank r holds columns [r*%lld/P, (r+1)*%lld/P) of every row "
               "(%s columns each)\n", (long long)cols, (long long)cols, each.c_str());

  // [slide:op-create]
  MPI_Datatype state_type;
  mpiCheck(MPI_Type_contiguous(2, MPI_FLOAT, &state_type));
  mpiCheck(MPI_Type_commit(&state_type));
  MPI_Op state_op;
  mpiCheck(MPI_Op_create(merge_op, /*commute=*/1, &state_op));

  std::vector<SoftmaxState> by_chain = chain_merge(comm, local);
  std::vector<SoftmaxState> by_allreduce = allreduce_merge(comm, local, state_type, state_op);
  // [/slide]
  const RepTimes chain_us = time_reps(comm, reps, [&] { chain_merge(comm, local); });
  const RepTimes allreduce_us =
      time_reps(comm, reps, [&] { allreduce_merge(comm, local, state_type, state_op); });
  // What is exact about the two, whatever the machine's noise: the merge steps one after
  // another on the critical path. The chain: P-1 hops, then a broadcast tree of ceil(log2 P)
  // rounds. An allreduce by recursive doubling: ceil(log2 P) rounds.
  const int log2P = (int)std::ceil(std::log2((double)P));
  lesson.print("    (a) chain r-1 -> r -> r+1, then bcast   median %9.1f us  (%d sequential steps: "
               "P-1 hops + log2 P bcast rounds)\n", chain_us.median, P - 1 + log2P);
  lesson.print("    (b) MPI_Allreduce, user-defined op     median %9.1f us  (%d sequential steps: "
               "log2 P rounds)\n", allreduce_us.median, log2P);

  // Each rank normalises its own columns with the merged state; every rank gathers the
  // slices and compares the whole with the single-process softmax.
  std::vector<size_t> slice_bytes((size_t)P);
  for (int peer = 0; peer < P; peer++) {
    int64_t from, to;
    split_range(cols, P, peer, &from, &to);
    slice_bytes[(size_t)peer] = (size_t)(rows * (to - from)) * sizeof(float);
  }
  auto gather_softmax = [&](const std::vector<SoftmaxState>& merged) {
    Tensor y_mine = Tensor::empty({rows, my_cols});
    if (on_device)
      y_mine = device_normalise(x_mine.to(dev), merged);
    else
      for (int64_t r = 0; r < rows; r++)
        normalise(y_mine.data() + r * my_cols, x_mine.data() + r * my_cols, my_cols,
                  merged[(size_t)r]);
    std::vector<float> all((size_t)(rows * cols));
    comm.allgatherv(y_mine.data(), y_mine.nbytes(), all.data(), slice_bytes);
    Tensor y = Tensor::empty({rows, cols});  // reassemble: slice peer is (rows, its columns)
    size_t off = 0;
    for (int peer = 0; peer < P; peer++) {
      int64_t from, to;
      split_range(cols, P, peer, &from, &to);
      for (int64_t r = 0; r < rows; r++)
        for (int64_t j = from; j < to; j++) y.data()[r * cols + j] = all[off++];
    }
    return y;
  };
  Tensor y_chain, y_allreduce;
  {
    Trace::Category check_traffic(trace(), "check");  // gathering to compare: the check's traffic
    y_chain = gather_softmax(by_chain), y_allreduce = gather_softmax(by_allreduce);
    check.close("chain     vs single-process softmax", y_chain, reference, atol_x, rtol_x);
    check.close("allreduce vs single-process softmax", y_allreduce, reference, atol_x, rtol_x);
  }

  // ---------------- [3] flash-decoding: queries x keys sharded over ranks
  const int64_t queries = rows, dim_qk = dim, dim_v = dim;
  const float scale = 1.f / std::sqrt((float)dim_qk);
  int64_t key0, key1;
  split_range(keys, P, rank, &key0, &key1);
  const uint64_t seed = (uint64_t)lesson.flags.seed;
  Tensor q = randn({queries, dim_qk}, seed + 1);
  Tensor k_local = randn_slice({keys, dim_qk}, 0, key0, key1, seed + 2);
  Tensor v_local = randn_slice({keys, dim_v}, 0, key0, key1, seed + 3);
  // Local state per query: scores s = k.q * scale, (m, l) over local keys, o = sum exp(s-m) v.
  const int64_t width = 2 + dim_v;
  std::vector<float> mlo = local_decode_state(q, k_local, v_local, block, dev);
  // [slide:mlo-allreduce]
  MPI_Datatype mlo_type;
  mpiCheck(MPI_Type_contiguous((int)width, MPI_FLOAT, &mlo_type));
  mpiCheck(MPI_Type_commit(&mlo_type));
  MPI_Op mlo_op;
  mpiCheck(MPI_Op_create(merge_mlo_op, /*commute=*/1, &mlo_op));
  comm.allreduce(mlo.data(), (int)queries, mlo_type, mlo_op);
  Tensor out = Tensor::empty({queries, dim_v});
  for (int64_t i = 0; i < queries; i++)
    for (int64_t c = 0; c < dim_v; c++)
      out.data()[i * dim_v + c] = mlo[(size_t)(i * width + 2 + c)] / mlo[(size_t)(i * width + 1)];
  // [/slide]
  // Reference on every rank: the whole K and V, softmax(q K^T * scale) V with the library ops.
  Tensor K = randn({keys, dim_qk}, seed + 2), V = randn({keys, dim_v}, seed + 3);
  Tensor attn_ref = matmul(softmax(scale * matmul(q, transpose(K, 0, 1))), V);
  // o sums `keys` terms p*v with |v| ~ 1: the n*eps/2 bound again, on an absolute scale
  // set by the largest |v| (outputs near 0 are compared absolutely).
  const double rtol_o = (double)keys * FLT_EPSILON / 2, atol_o = rtol_o * max_abs(V);
  lesson.print("[3] flash-decoding: softmax(q K^T / sqrt(%lld)) V for %lld queries, %lld keys "
               "split over %d ranks, (m, l, o) merged by MPI_Allreduce\n",
               (long long)dim_qk, (long long)queries, (long long)keys, P);
  check.close("split-K attention vs single-process", out, attn_ref, atol_o, rtol_o);

  // ---------------- outputs: dump, csv (the trace is written by finish)
  if (lesson.dumping()) dump_outputs(lesson, local, x, y_allreduce, q, K, V, out);
  lesson.csv_append("P,rows,cols,block,series,x,y,y_min,y_max",
                    csv_rows(P, x, block, chain_us, allreduce_us, log2P));

  MPI_Op_free(&state_op);
  MPI_Op_free(&mlo_op);
  MPI_Type_free(&state_type);
  MPI_Type_free(&mlo_type);
  return lesson.finish(check);
}

int main(int argc, char** argv) {
  return run_lesson(argc, argv, "01_online_softmax", online_softmax_lesson);
}
