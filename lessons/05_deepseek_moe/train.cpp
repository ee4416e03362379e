// lessons/05_deepseek_moe/train.cpp — balancing over training (--train STEPS): the layer of
// main.cpp inside a tiny next-character model, trained on tinyshakespeare, to watch the expert
// loads under three balancing schemes and two planted mistakes.
//
//   ids (B, L) -> embedding -> h0 -> RMSNorm -> u -> MoE (main.cpp's expert-parallel layer) -> m
//   h1 = h0 + m  -> LM head -> logits -> cross-entropy (+ alpha L_bal with --balance aux)
//
// Data parallel outside the MoE: every rank takes its own rows of the global batch (the
// corpus builds any rank's rows from a counter-based hash, so they are the same whatever P),
// the dense gradients are all-reduced, each rank updates its own experts. Adam everywhere.
//
// Balancing (--balance):
//   none  the gate as given (--gate), no balancing at all;
//   aux   the softmax gate and the balance loss with weight --aux-alpha: the router's gradient
//         is pushed toward uniform loads (lesson 03's auxiliary loss, per sequence);
//   bias  the sigmoid gate and DeepSeek-V3's auxiliary-loss-free update at the END of each
//         step: b_i += gamma * sign(mean load - load_i), with the loads of this step's router
//         choices summed over every rank that routed tokens (an all-reduce), so every rank
//         applies the same update to the same bias. The next step selects with it.
//   With --bias-ema beta the update follows a smoothed load fraction instead,
//   est = beta est + (1 - beta) load / (T K), b_i += gamma * sign(1/N - est_i), est starting at 1/N.
// Planted (--bug, with --train):
//   ema-zero-init  the smoothed estimate starts at zeros (seed 000's bug): every est_i is below
//                  1/N at first, every bias rises by the same gamma, nothing is steered until
//                  the estimate has climbed to 1/N — about 1/(1 - beta) steps.
//   bias-peek      seed 000's "update bias BEFORE routing" read literally: route the step's
//                  batch once, update the bias from THIS batch's loads, then run the step with
//                  it. The paper's order (update at the end of a step, use it from the next)
//                  is the same thing as "before the next step's routing"; the literal reading
//                  lets a batch steer its own routing, a peek no inference step can make.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "common/core/optim.h"
#include "common/lesson/corpus.h"
#include "lessons/05_deepseek_moe/deepseek_moe.h"

namespace ff::deepseek {

namespace {

struct Model {
  Tensor emb, norm_w, head;  // (V, d), (d), (d, V): replicated
  dsv3::Params moe;          // router, bias and shared experts replicated; experts: see below
  dsv3::Params mine;         // the experts this process updates (all of them on one process)
};

Model init_model(const dsv3::Config& c, int64_t V, uint64_t seed, int rank, int P, Device dev) {
  Model m;
  const int64_t d = c.dim, E = c.experts / P;
  m.emb = (randn({V, d}, seed + 20) * 0.5f).to(dev);
  m.norm_w = Tensor::full({d}, 1.f, dev);
  m.head = (randn({d, V}, seed + 21) * (1.f / std::sqrt((float)d))).to(dev);
  m.moe = dsv3::init_params(c, seed, 0.0, dev);  // the bias starts at 0 and is learned
  m.mine = dsv3::slice_experts(m.moe, rank * E, (rank + 1) * E);
  if (P == 1) m.mine = m.moe;
  return m;
}

// The parameters Adam updates, with their gradients in the same order.
std::vector<Tensor*> trainable(Model& m, const dsv3::Config& c) {
  std::vector<Tensor*> p = {&m.emb, &m.norm_w, &m.head, &m.moe.router_w,
                            &m.mine.w1, &m.mine.w3, &m.mine.w2};
  if (c.shared > 0) p.insert(p.end(), {&m.moe.sw1, &m.moe.sw3, &m.moe.sw2});
  return p;
}

struct StepResult {
  double ce = 0, balance = 0;      // mean cross-entropy and the balance loss, all tokens
  std::vector<double> load;        // router choices per expert, all tokens
  int64_t dropped = 0;
};

// The router's choices on x, counted per expert over every rank (one all-reduce).
std::vector<double> router_loads(Comm& comm, const dsv3::Config& c, const dsv3::Params& p,
                                 const Tensor& x) {
  std::vector<double> load((size_t)c.experts, 0.0);
  for (int64_t e : dsv3::select(c, dsv3::affinities(c, p, x), p.bias).idx.to_index_vector())
    load[(size_t)e] += 1;
  comm.allreduce(load.data(), (int)load.size(), MPI_DOUBLE, MPI_SUM);
  return load;
}

// One step on this process's rows (T = rows * L tokens): forward, backward, gradients summed
// over the ranks, Adam. `distributed`: the MoE runs expert-parallel over comm; else this one
// process holds every expert and every row.
StepResult train_step(Comm& comm, Topology& topo, Scheme scheme, const dsv3::Config& c,
                      Model& m, Adam& adam, const Tensor& ids, const Tensor& targets,
                      int64_t T_all, bool distributed) {
  const int64_t T = ids.numel();
  const float share = (float)((double)T / (double)T_all);  // this process's part of the mean
  for (Tensor* t : {&m.emb, &m.norm_w, &m.head}) t->zero_grad(), t->requires_grad_();
  Tensor h0 = embedding(m.emb, reshape(ids, {T}));
  Tensor u = rmsnorm(h0, m.norm_w);
  Tensor u_in = u.detach();
  // the MoE layer, forward (hand-written; outside the autograd tape)
  StepResult r;
  EPForward ef;
  dsv3::Forward sf;
  Tensor moe_out;
  if (distributed) {
    ef = ep_forward(comm, topo, scheme, c, m.moe, m.mine, u_in);
    moe_out = ef.y, r.balance = ef.balance;
    for (const dsv3::ExpertLoad& L : ef.map.assign.experts)
      r.load.push_back((double)L.demand), r.dropped += L.dropped;
  } else {
    sf = dsv3::forward(c, m.moe, u_in);
    moe_out = sf.y, r.balance = sf.balance;
    for (const dsv3::ExpertLoad& L : sf.assign.experts)
      r.load.push_back((double)L.demand), r.dropped += L.dropped;
  }
  Tensor m_leaf = moe_out.detach().requires_grad_();
  Tensor logits = matmul(add(h0, m_leaf), m.head);
  Tensor ce = scale(cross_entropy(logits, reshape(targets, {T})), share);
  r.ce = ce.item();
  comm.allreduce(&r.ce, 1, MPI_DOUBLE, MPI_SUM);
  // backward: the dense tape down to the MoE's output, the MoE by hand, the tape below it
  ce.backward();
  dsv3::Grads g = distributed
                      ? ep_backward(comm, topo, scheme, c, m.moe, m.mine, u_in, ef, m_leaf.grad(),
                                    dsv3::Bug::none)
                      : dsv3::backward(c, m.moe, u_in, sf, m_leaf.grad());
  u.backward(g.dx);
  std::vector<Tensor> grads = {m.emb.grad(), m.norm_w.grad(), m.head.grad(), g.router_w,
                               g.w1, g.w3, g.w2};
  if (c.shared > 0) grads.insert(grads.end(), {g.sw1, g.sw3, g.sw2});
  if (distributed)  // the dense gradients (router and shared: already summed in ep_backward)
    for (int i = 0; i < 3; i++) comm.allreduce_sum(grads[(size_t)i]);
  {
    NoGradGuard no_grad;
    for (Tensor* t : {&m.emb, &m.norm_w, &m.head}) t->requires_grad_(false);
    adam.step(trainable(m, c), grads);
  }
  return r;
}

double imbalance(const std::vector<double>& load) {
  double mx = 0, mean = 0;
  for (double l : load) mx = std::max(mx, l), mean += l / (double)load.size();
  return mean > 0 ? mx / mean : 0;
}

}  // namespace

int run_training(Lesson& lesson, Topology& topo, Scheme scheme, dsv3::Config config,
                 const TrainOptions& options) {
  Comm& comm = lesson.comm;
  const int rank = comm.rank(), P = comm.size();
  const Device dev = lesson.device;
  const uint64_t seed = (uint64_t)lesson.flags.seed;
  std::string error;
  CharCorpus corpus;
  error = CharCorpus::try_load(options.data, &corpus);
  lesson.usage_error_if(!error.empty(), error);
  const int64_t vocab = corpus.vocab_size(), seq_len = config.seq_len, B_all = options.batch * P;
  const int64_t T_all = B_all * seq_len;
  // the balancing: aux, the softmax gate and its balance loss; bias, DeepSeek-V3's: the sigmoid
  // gate, the bias update and a sequence-wise loss of tiny weight beside it
  if (options.balance == "aux") config.gate = dsv3::GateFn::softmax, config.alpha = options.aux_alpha;
  else if (options.balance == "bias") config.gate = dsv3::GateFn::sigmoid, config.alpha = options.seq_alpha;
  else config.alpha = 0;
  const bool ema_bug = options.bug == "ema-zero-init", peek = options.bug == "bias-peek";
  char seq_loss[64] = "";
  if (options.balance == "bias" && config.alpha > 0)
    std::snprintf(seq_loss, sizeof seq_loss, " + sequence-wise loss (alpha %g)", config.alpha);
  lesson.print("== 05 training: %lld steps, %lld sequences of %lld characters per step (%lld per "
               "rank), vocabulary %lld, d=%lld, %lld experts top-%lld, %lld shared, gate %s, "
               "balance %s%s%s%s, all-to-all %s, device %s\n",
               (long long)options.steps, (long long)B_all, (long long)seq_len, (long long)options.batch,
               (long long)vocab, (long long)config.dim, (long long)config.experts, (long long)config.topk,
               (long long)config.shared, dsv3::gate_name(config.gate), options.balance.c_str(),
               seq_loss,
               options.bug != "none" ? ", planted: " : "", options.bug != "none" ? options.bug.c_str() : "",
               scheme == Scheme::flat ? "flat" : "hierarchical", device_name(dev));

  // the run and, when it has at most 20 steps, the same run on one process over the same
  // global batches (the check re-runs them all)
  const int64_t check_steps = std::min<int64_t>(options.steps, 20);
  struct Run {
    Model model;
    Adam adam;
    dsv3::BiasUpdater bias;  // the load-based bias update (common/layers/dsv3_moe.h)
    std::vector<double> losses;
  };
  auto make_run = [&](int run_rank, int run_size) {
    AdamConfig adam_config;
    adam_config.lr = options.lr;
    Run run{init_model(config, vocab, seed, run_rank, run_size, dev), Adam(adam_config),
            dsv3::BiasUpdater{}, {}};
    run.bias.gamma = options.balance == "bias" ? options.gamma : 0.0;
    run.bias.beta = ema_bug && options.ema == 0 ? 0.99 : options.ema;
    run.bias.est.assign((size_t)config.experts, ema_bug ? 0.0 : 1.0 / (double)config.experts);
    return run;
  };
  Run dist = make_run(rank, P);
  Run one = make_run(0, 1);
  Comm self = comm.split(rank, 0);
  lesson.start_trace();
  std::string csv;
  lesson.print("  %5s %8s %9s %10s %8s\n", "step", "loss", "balance", "max/mean", "dropped");
  auto step_once = [&](Run& run, Comm& step_comm, bool distributed, int64_t step) {
    CharCorpus::Batch batch = corpus.batch(CharCorpus::Split::train, step, B_all, seq_len,
                                           distributed ? rank * options.batch : 0,
                                           distributed ? (rank + 1) * options.batch : B_all, seed);
    Tensor ids = batch.inputs.to(dev), targets = batch.targets.to(dev);
    // [slide:step-order]
    if (peek && run.bias.gamma > 0) {  // the planted order: this batch's loads steer its routing
      Tensor normed = rmsnorm(embedding(run.model.emb, reshape(ids, {ids.numel()})), run.model.norm_w);
      const std::vector<double> loads = router_loads(step_comm, config, run.model.moe, normed.detach());
      run.model.moe.bias = run.bias.updated(run.model.moe.bias, loads, (double)(T_all * config.topk));
    }
    StepResult result = train_step(step_comm, topo, scheme, config, run.model, run.adam, ids, targets,
                                   T_all, distributed);
    if (!peek && run.bias.gamma > 0)  // DeepSeek-V3: at the end of the step, for the next one
      run.model.moe.bias = run.bias.updated(run.model.moe.bias, result.load, (double)(T_all * config.topk));
    // [/slide]
    run.model.mine.bias = run.model.moe.bias;
    run.losses.push_back(result.ce + result.balance);
    return result;
  };
  for (int64_t step = 0; step < options.steps; step++) {
    StepResult result = step_once(dist, comm, P > 1, step);
    if (step % options.log_every == 0 || step + 1 == options.steps)
      lesson.print("  %5lld %8.4f %9.5f %10.2f %8lld\n", (long long)step, result.ce, result.balance,
                   imbalance(result.load), (long long)result.dropped);
    char line[160];
    std::snprintf(line, sizeof line, "train,%d,%s,%s,%lld,%.6f,%.6f,%.4f,%lld\n", P,
                  options.balance.c_str(), options.bug.c_str(), (long long)step, result.ce,
                  result.balance, imbalance(result.load), (long long)result.dropped);
    csv += line;
  }
  lesson.csv_append("series,P,balance,bug,step,loss,balance_loss,max_over_mean,dropped", csv);

  // ---- the check: the first steps again on one process, all rows, every expert
  Trace::Category check_traffic(trace(), "check");
  CheckReport check(comm);
  std::vector<float> bias_all = allgather_vec(comm, dist.model.moe.bias.to_vector());
  bool same_bias = true;
  for (int p = 1; p < P; p++)
    same_bias &= std::equal(bias_all.begin(), bias_all.begin() + config.experts,
                            bias_all.begin() + p * config.experts);
  check.holds("the bias is the same on every rank", same_bias);
  if (P > 1 && check_steps < options.steps)
    lesson.print("(the one-process comparison runs for --train %lld or fewer steps: this run checks the "
                 "bias only)\n", (long long)check_steps);
  if (P > 1 && check_steps == options.steps) {
    for (int64_t step = 0; step < check_steps; step++) step_once(one, self, false, step);
    const double eps = FLT_EPSILON;
    double worst = 0;
    for (int64_t step = 0; step < check_steps; step++)  // losses are below 8 nats
      worst = std::max(worst, std::fabs(dist.losses[(size_t)step] - one.losses[(size_t)step]));
    // Both runs add the same float32 terms in different orders (the all-reduces, the split of
    // the batch): each sum of n terms differs by about n eps of its size, n at most the rows
    // of one rank plus d plus the vocabulary; Adam's steps carry such differences forward, one
    // step's worth per step. 4 n eps per step, relative.
    const double tol = 4.0 * (double)(T_all / P + config.dim + vocab) * eps * (double)check_steps;
    check.scalar("loss after the last step, against one process", dist.losses.back(),
                 one.losses.back(), tol * std::max(std::fabs(one.losses.back()), 1.0));
    check.holds("loss of every step within the same tolerance", worst <= tol * 8.0);
    auto ptol = [&](const Tensor& t) { return tol * std::max(max_abs(t), 1e-3); };
    const int64_t E = config.experts / P;
    check.close("embedding", dist.model.emb, one.model.emb, ptol(one.model.emb));
    check.close("LM head", dist.model.head, one.model.head, ptol(one.model.head));
    check.close("router_w", dist.model.moe.router_w, one.model.moe.router_w, ptol(one.model.moe.router_w));
    check.close("bias", dist.model.moe.bias, one.model.moe.bias, ptol(one.model.moe.bias));
    check.close("experts_w1 (this rank's)", dist.model.mine.w1,
                slice(one.model.moe.w1, 0, rank * E, (rank + 1) * E), ptol(one.model.moe.w1));
    check.close("experts_w2 (this rank's)", dist.model.mine.w2,
                slice(one.model.moe.w2, 0, rank * E, (rank + 1) * E), ptol(one.model.moe.w2));
    if (config.shared > 0)
      check.close("shared_w1", dist.model.moe.sw1, one.model.moe.sw1, ptol(one.model.moe.sw1));
  }
  return lesson.finish(check);
}

}  // namespace ff::deepseek
