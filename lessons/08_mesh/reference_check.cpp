// lessons/08_mesh/reference_check.cpp — gathering the mesh for the check (reference_check.h).
#include "lessons/08_mesh/reference_check.h"

#include "common/core/npy.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <utility>

#include "lessons/08_mesh/mesh_model.h"

#include "common/core/autograd.h"
#include "common/core/ops.h"

namespace ff::mesh {

// The same bits (sizes included; an empty vector may have no storage to compare).
bool same_floats(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// local: this rank's tensors of the names its pipeline stages hold, in names' order.
Gathered gather_full(const std::vector<std::string>& names, const std::vector<Shape>& full_shapes,
                     const std::vector<Tensor>& local, const MeshSizes& sizes, const StagePlan& plan,
                     Comm& world) {
  std::vector<float> mine;
  for (const Tensor& t : local) {
    const std::vector<float> v = t.to_vector();
    mine.insert(mine.end(), v.begin(), v.end());
  }
  const int W = world.size();
  std::vector<int64_t> counts((size_t)W);
  int64_t n = (int64_t)mine.size();
  world.allgather(&n, sizeof n, counts.data());
  std::vector<size_t> bytes((size_t)W);
  std::vector<size_t> offset((size_t)W + 1, 0);
  for (int r = 0; r < W; r++) {
    bytes[(size_t)r] = (size_t)counts[(size_t)r] * sizeof(float);
    offset[(size_t)r + 1] = offset[(size_t)r] + (size_t)counts[(size_t)r];
  }
  std::vector<float> all(offset[(size_t)W]);
  world.allgatherv(mine.data(), mine.size() * sizeof(float), all.data(), bytes);

  // Walk every rank's buffer with that rank's local shapes (empty: a name it does not hold).
  std::vector<std::vector<Tensor>> pieces((size_t)W);
  for (int r = 0; r < W; r++) {
    const MeshCoords co = mesh_coords(sizes, r);
    size_t at = offset[(size_t)r];
    for (size_t k = 0; k < names.size(); k++) {
      if (!plan.holds(names[k], co.pp)) {
        pieces[(size_t)r].push_back(Tensor());
        continue;
      }
      const Shape s = local_shape(full_shapes[k], split_of(names[k], sizes.ep), co, sizes);
      int64_t numel = 1;
      for (int64_t d : s) numel *= d;
      pieces[(size_t)r].push_back(Tensor::from_vector(
          std::vector<float>(all.begin() + (long)at, all.begin() + (long)(at + (size_t)numel)), s));
      at += (size_t)numel;
    }
  }
  Gathered g;
  const int stage_ranks = sizes.dp * sizes.cp * sizes.tp;
  for (size_t k = 0; k < names.size(); k++) {
    const Split s = split_of(names[k], sizes.ep);
    const int q = plan.rank_of(names[k]);  // the pipeline rank holding its stage
    // the parts to join, from the first block of ranks of that pipeline rank: TP rank t's shard
    // from (tp t, all else 0); EP rank e's experts from the block's rank e
    std::vector<Tensor> parts;
    if (s == Split::expert)
      for (int e = 0; e < sizes.ep; e++) parts.push_back(pieces[(size_t)(q * stage_ranks + e)][k]);
    else
      for (int t = 0; t < sizes.tp; t++) parts.push_back(pieces[(size_t)mesh_rank(sizes, {t, 0, 0, 0, q, 0})][k]);
    // every copy equals its reference copy: DP replicas the TP shard of dp 0, expert-DP
    // replicas the experts of EP rank e, and a replicated weight the one of rank 0
    for (int r = 0; r < W && g.disagree.empty(); r++) {
      const MeshCoords co = mesh_coords(sizes, r);
      if (!plan.holds(names[k], co.pp)) continue;
      const int t = s == Split::replicated ? 0 : s == Split::expert ? co.ep : co.tp;
      const std::vector<float> a = pieces[(size_t)r][k].to_vector(), b = parts[(size_t)t].to_vector();
      if (!same_floats(a, b))
        g.disagree = names[k] + " (rank " + std::to_string(r) + ")";
    }
    NoGradGuard no_grad;
    g.full.push_back(s == Split::replicated ? parts[0]
                                            : concat(parts, s == Split::column ? 1 : 0));
  }
  return g;
}


// max |got - want| as a fraction of the bound kLossBound n eps max|want| (above): 1 fails.
double error_ratio(const Tensor& got, const Tensor& want, double n) {
  const std::vector<float> a = got.to_vector(), b = want.to_vector();
  double diff = 0, big = 0;
  for (size_t i = 0; i < a.size(); i++) {
    diff = std::max(diff, (double)std::fabs(a[i] - b[i]));
    if (std::isnan(a[i]) || std::isnan(b[i])) diff = INFINITY;
    big = std::max(big, (double)std::fabs(b[i]));
  }
  const double bound = kLossBound * n * std::numeric_limits<float>::epsilon() * std::max(big, 1e-30);
  return diff / bound;
}

double precision_ratio(const Tensor& got, const Tensor& g16, const std::vector<float>& g32, double norm16, double n) {
  const std::vector<float> a = got.to_vector(), b = g16.to_vector();
  double err = 0, size = 0;
  for (size_t i = 0; i < a.size(); i++) {
    err += ((double)a[i] - g32[i]) * ((double)a[i] - g32[i]);
    size += (double)b[i] * b[i];
  }
  const double bound = 2 * norm16 + kLossBound * n * std::numeric_limits<float>::epsilon() * std::sqrt(size);
  return std::isnan(err) ? INFINITY : std::sqrt(err) / std::max(bound, 1e-30);
}

// t in dtype d (--precision bf16: the gathered weights are float32, the twin's matmul weights bf16)
static Tensor in_dtype(const Tensor& t, DType d) { return t.dtype() == d ? t : t.to_dtype(d); }

OneProcess::OneProcess(const Lesson& lesson, Config config, const CharCorpus& corpus)
    : c(config.model), precision(config.precision), low(precision != "fp32"), bias_rate(config.bias_rate), bug_kpe(config.bug_kpe), names(std::move(config.names)),
      n_terms(config.n_terms), corpus(corpus), batch(config.batch), T(c.seq_len), seed((uint64_t)lesson.flags.seed),
      device(lesson.device), adam_dev(config.zero_stage >= 1 ? Device::cpu : lesson.device), ref_adam(config.adam) {
  if (lesson.rank() != 0) return;
  ref = model::init_params(c, seed, device);
  if (precision == "bf16") ref.hold_matmuls_in_bf16();
  if (low) {  // the float32 twin of the same weights (the bound's)
    ref32 = model::zero_params(c, device);
    ref32_named = ref32.named_parameters();
  }
  ref_named = ref.named_parameters();
  for (model::NamedTensor& n : ref_named) ref_params.push_back(&n.t);
}

void OneProcess::resume(const std::string& dir, int64_t adam_steps) {
  if (ref_params.empty()) return;  // not rank 0
  std::vector<Tensor> m, v, masters;  // (bf16 weights: the checkpoint holds their float32 masters)
  for (size_t k = 0; k < names.size(); k++) {
    const Tensor w = load_npy(dir + "/" + names[k] + ".npy");
    ref_params[k]->detach().copy_from(in_dtype(w, ref_params[k]->dtype()).to(device));
    masters.push_back(ref_params[k]->dtype() == DType::bf16 ? w.to(adam_dev) : Tensor());
    m.push_back(load_npy(dir + "/" + names[k] + ".exp_avg.npy").to(adam_dev));
    v.push_back(load_npy(dir + "/" + names[k] + ".exp_avg_sq.npy").to(adam_dev));
  }
  for (model::NamedTensor& b : ref.named_buffers()) b.t.copy_from(load_npy(dir + "/" + b.name + ".npy").to(device));
  for (Tensor* p : ref_params) ref_adam_params.push_back(p->detach().to(adam_dev).clone());
  if (adam_steps > 0) ref_adam.restore(m, v, adam_steps, masters);
}

model::Output OneProcess::float32_forward(const Tensor& inputs, const Tensor& targets) {
  const model::LinearScope float32(model::LinearFn{});  // fp8: the linear layers' matmuls again
  const moe::ExpertGemmScope float32_experts(moe::GemmFn{});  // and the experts' grouped GEMMs
  for (size_t k = 0; k < ref_params.size(); k++) {
    ref32_named[k].t.zero_grad();
    ref32_named[k].t.detach().copy_from(in_dtype(ref_params[k]->detach(), DType::f32));
  }
  const std::vector<model::NamedTensor> b16 = ref.named_buffers(), b32 = ref32.named_buffers();
  for (size_t i = 0; i < b16.size(); i++) b32[i].t.copy_from(b16[i].t);
  return model::forward(c, ref32, inputs.to(device), targets.to(device), model::positions(T, device));
}

// Each token's cross-entropy, from its logits (rows) and target: -log_softmax at the target.
static std::vector<double> token_losses(const Tensor& logits, const Tensor& targets) {
  NoGradGuard no_grad;
  const std::vector<float> lp = log_softmax(logits.detach()).to_vector();
  const std::vector<int64_t> t = targets.to_index_vector();
  const size_t V = (size_t)logits.size(1);
  std::vector<double> out(t.size());
  for (size_t r = 0; r < t.size(); r++) out[r] = -(double)lp[r * V + (size_t)t[r]];
  return out;
}

double mean_token_error(const Tensor& logits_low, const Tensor& logits32, const Tensor& targets) {
  const std::vector<double> a = token_losses(logits_low, targets), b = token_losses(logits32, targets);
  double e = 0;
  for (size_t i = 0; i < a.size(); i++) e += std::fabs(a[i] - b[i]);
  return e / (double)std::max<size_t>(a.size(), 1);
}

PrecisionErrors OneProcess::float32_twin(const CharCorpus::Batch& gb, const Tensor& logits_low) {
  model::Output out = float32_forward(gb.inputs, gb.targets);
  out.loss.backward();
  PrecisionErrors e;
  e.loss32 = out.loss.item();
  e.token_err = mean_token_error(logits_low, out.logits, gb.targets);
  for (size_t k = 0; k < ref_params.size(); k++) {
    const Tensor& g32 = ref32_named[k].t.grad();
    e.g32.push_back(g32.defined() ? g32.to_vector() : std::vector<float>((size_t)ref_params[k]->numel(), 0.f));
    const std::vector<float> g16 = ref_params[k]->grad().defined() ? ref_params[k]->grad().to_vector()
                                                                  : std::vector<float>(e.g32.back().size(), 0.f);
    double s = 0;
    for (size_t i = 0; i < g16.size(); i++) s += ((double)g16[i] - e.g32[k][i]) * ((double)g16[i] - e.g32[k][i]);
    e.norm16.push_back(std::sqrt(s));
  }
  return e;
}


OneProcess::Step OneProcess::step(Lesson& lesson, int64_t step, bool checking, bool last, double loss_mesh,
                                  const Gathered& g_grad, const Gathered& g_par,
                                  const std::vector<float>& my_bias, const std::vector<float>& mesh_load) {
  double loss_ref = NAN, grad_ratio = 0, loss_slack = 0;
  PrecisionErrors e32;  // bf16, fp8: one process's float32 gradients and its own ones' errors
  std::string step_adam = "=";
  // the reference gradient from the same weights and the whole global batch
  std::vector<float> ref_load;
  if (checking) {
    checked_steps++;
    CharCorpus::Batch gb = corpus.batch(CharCorpus::Split::train, step, batch, T, 0, batch,
                                        seed);
    for (Tensor* p : ref_params) p->zero_grad();
    model::Output out = model::forward(c, ref, gb.inputs.to(device), gb.targets.to(device),
                                       model::positions(T, device));
    out.loss.backward();
    loss_ref = out.loss.to_vector()[0];
    if (low) {
      e32 = float32_twin(gb, out.logits);
      loss_slack = 2 * e32.token_err;
    }
    if (lesson.dumping() && last) {
      // the last step as the mesh ran it: the weights before it, the global batch, the
      // mesh's loss and its mean gradient of every weight (gathered over TP, DP and CP)
      for (size_t k = 0; k < names.size(); k++) {
        lesson.dump("last_step." + names[k], *ref_params[k]);
        lesson.dump("last_step.grad." + names[k], g_grad.full[k]);
      }
      for (const model::NamedTensor& n : ref.named_buffers()) lesson.dump("last_step." + n.name, n.t);
      lesson.dump("last_step.inputs", gb.inputs);
      lesson.dump("last_step.targets", gb.targets);
      lesson.dump("last_step.loss", Tensor::from_vector({(float)loss_mesh}, {}));
    }
    double lr_ratio = std::fabs(loss_mesh - loss_ref) /
                      (kLossBound * n_terms * eps * std::max(1.0, std::fabs(loss_ref)) + loss_slack);
    if (std::isnan(lr_ratio)) lr_ratio = INFINITY;
    if (lr_ratio > worst_loss.ratio || worst_loss.step < 0) worst_loss = {lr_ratio, "loss", step};
    if (step == 0) first_loss_ratio = lr_ratio;
    for (size_t k = 0; k < names.size(); k++) {
      Tensor want = ref_params[k]->grad().defined() ? ref_params[k]->grad()
                                                    : Tensor::zeros(ref_params[k]->shape());
      Tensor got = g_grad.full[k];
      if (bug_kpe && got.shape() != want.shape()) got = slice(got, 1, 0, c.d_rope);
      double r = low ? precision_ratio(got, want, e32.g32[k], e32.norm16[k], n_terms) : error_ratio(got, want, n_terms);
      if (std::isnan(r)) r = INFINITY;
      grad_ratio = std::max(grad_ratio, r);
      if (r > worst_grad.ratio || worst_grad.step < 0) worst_grad = {r, names[k], step};
    }
    std::vector<Route> ref_routes;
    for (size_t l = 0; l < out.routes.size(); l++) ref_routes.push_back({(int64_t)l, out.routes[l]});
    ref_load = expert_loads(ref_routes, c);
    if (low) {  // the mesh's own loads, which must count as many routes per MoE layer (tokens x K)
      for (size_t at = 0; at < ref_load.size(); at += (size_t)c.experts) {
        double own = 0, mesh = 0;
        for (size_t i = at; i < at + (size_t)c.experts; i++) own += ref_load[i], mesh += i < mesh_load.size() ? mesh_load[i] : 0;
        if (own != mesh) bias_equal = false;
      }
      ref_load = mesh_load;
    }
  }
  // AdamW on the mesh's own mean gradient, from the same weights: the same bits expected
  if (ref_adam_params.empty())
    for (Tensor* p : ref_params) ref_adam_params.push_back(p->detach().to(adam_dev).clone());
  std::vector<Tensor> grads;
  std::vector<Tensor*> ps;
  for (size_t k = 0; k < names.size(); k++) {
    Tensor gk = g_grad.full[k];
    if (bug_kpe && gk.shape() != ref_adam_params[k].shape()) gk = slice(gk, 1, 0, c.d_rope).clone();
    grads.push_back(gk.to(adam_dev));
    ps.push_back(&ref_adam_params[k]);
  }
  ref_adam.step(ps, grads);
  for (size_t k = 0; k < names.size(); k++) {
    Tensor mesh_w = g_par.full[k];
    if (bug_kpe && mesh_w.shape() != ref_adam_params[k].shape()) {
      // every head's copy of W_kr: one shared key means they stay equal
      for (int64_t h = 1; h < c.heads && kpe_copies_equal; h++)
        if (!bitwise_equal(slice(mesh_w, 1, 0, c.d_rope), slice(mesh_w, 1, h * c.d_rope, (h + 1) * c.d_rope)))
          kpe_copies_equal = false;
      mesh_w = slice(mesh_w, 1, 0, c.d_rope).clone();
    }
    if (!bitwise_equal(mesh_w, in_dtype(ref_adam_params[k], DType::f32))) {
      step_adam = "differ";
      if (adam_equal) adam_detail = names[k] + ", step " + std::to_string(step);
      adam_equal = false;
    }
    // resynchronise: the next step starts from the mesh's weights
    ref_adam_params[k].copy_from(in_dtype(mesh_w, ref_adam_params[k].dtype()).to(adam_dev));
    ref_params[k]->detach().copy_from(in_dtype(mesh_w, ref_params[k]->dtype()).to(device));
  }
  std::vector<model::NamedTensor> rb = ref.named_buffers();
  if (checking) {  // the reference's own bias update from its own routes
    update_biases(ref, ref_load, c.experts, bias_rate);
    std::vector<float> ref_bias;
    for (const model::NamedTensor& b : rb) {
      const std::vector<float> v = b.t.to_vector();
      ref_bias.insert(ref_bias.end(), v.begin(), v.end());
    }
    if (!same_floats(ref_bias, my_bias))
      bias_equal = false;
  }
  size_t at = 0;
  for (const model::NamedTensor& b : rb) {
    const size_t n = (size_t)b.t.numel();
    b.t.copy_from(Tensor::from_vector(std::vector<float>(my_bias.begin() + (long)at,
                                                         my_bias.begin() + (long)(at + n)),
                                      b.t.shape(), b.t.device()));
    at += n;
  }
  const double loss_bound = kLossBound * n_terms * eps * std::max(1.0, std::fabs(loss_ref)) + loss_slack;
  return {loss_ref, loss_bound, grad_ratio, step_adam};
}

void OneProcess::verdict(CheckReport& check, bool root) const {
  char line[512];
  std::snprintf(line, sizeof line,
                "loss of the mesh = one process's at %lld checked steps, |diff| <= 4 n eps |loss|%s "
                "(n = B T = %.0f): worst %.3f of the bound",
                (long long)checked_steps, !low ? "" : precision == "bf16" ? " + 2 mean|l16 - l32|" : " + 2 mean|l8 - l32|",
                n_terms, worst_loss.ratio);
  check.holds(line, !root || worst_loss.ratio <= 1.0);
  const char* g = precision == "bf16" ? "g16" : "g8";  // one process's gradient in this precision
  if (low)  // (reference_check.h: the check in bf16 and fp8)
    std::snprintf(line, sizeof line,
                  "mean gradient of every weight as accurate as one process's in %s, ||g - g32|| <= 2 ||%s - g32|| "
                  "+ 4 n eps ||%s||: worst %.3f of the bound (%s, step %lld)",
                  precision.c_str(), g, g, worst_grad.ratio, worst_grad.what.c_str(), (long long)worst_grad.step);
  else
    std::snprintf(line, sizeof line,
                  "mean gradient of every weight = one process's, max|diff| <= 4 n eps max|want|: "
                  "worst %.3f of the bound (%s, step %lld)",
                  worst_grad.ratio, worst_grad.what.c_str(), (long long)worst_grad.step);
  check.holds(line, !root || worst_grad.ratio <= 1.0);
  std::snprintf(line, sizeof line, "AdamW step = one process's on the same gradients, bit for bit, "
                "every step%s%s", adam_equal ? "" : ": first differs at ", adam_equal ? "" : adam_detail.c_str());
  check.holds(line, !root || adam_equal);
  check.holds(low ? "balancing bias = one process's update from the mesh's loads (as many routes per layer as its "
                    "own), bit for bit"
                  : "balancing bias = one process's update from its own routes, bit for bit",
              !root || bias_equal);
}

void OneProcess::kpe_verdict(CheckReport& check, bool root) const {
  char line[512];
  if (bug_kpe) {
    std::snprintf(line, sizeof line, "k_pe: the forward is unchanged, the loss of step 0 = one "
                  "process's (%.3f of the bound)", first_loss_ratio);
    check.holds(line, !root || first_loss_ratio <= 1.0);
    check.holds("k_pe: every head's copy of W_kr stays equal (one key shared by the heads)",
                !root || kpe_copies_equal);
  }
}

CheckedStep check_step(Lesson& lesson, OneProcess& twin, CheckComms& comms, const StepOnMesh& s, std::string* disagree) {
  const RankModel& here = s.here;
  const MeshSizes& sizes = s.sizes;
  Trace::Category check_traffic(trace(), "check");
  const ParamTable& table = here.table;
  CheckedStep out;
  out.loss_mesh = s.local_loss;
  comms.world.allreduce(&out.loss_mesh, 1, MPI_DOUBLE, MPI_SUM);
  out.loss_mesh /= (double)(comms.dp_cp.size() * sizes.tp);
  // the mean gradient each rank's optimizer used, and the weights after its step
  std::vector<Tensor> mean_grads(table.params.size());
  for (const zero::GroupAdam* opt : {&s.dense, &s.replicated, &s.experts}) {
    const std::vector<Tensor> mg = opt->mean_grads(opt == &s.experts ? comms.edp : comms.dp_cp);
    for (size_t i = 0; i < mg.size(); i++) mean_grads[opt->keys[i]] = mg[i];
  }
  std::vector<Tensor> now, held_grads;
  for (size_t k = 0; k < table.names.size(); k++)
    if (table.params[k]) now.push_back(*table.params[k]), held_grads.push_back(mean_grads[k]);
  for (const model::NamedTensor& b : here.model.weights.named_buffers())  // the biases, with the weights
    if (b.t.defined()) now.push_back(b.t);
  const Gathered grads = gather_full(table.names, table.full_shapes, held_grads, sizes, here.plan, comms.world);
  const Gathered params = gather_full(table.all_names, table.all_shapes, now, sizes, here.plan, comms.world);
  if (disagree->empty() && !params.disagree.empty()) *disagree = "weights " + params.disagree;
  if (disagree->empty() && !grads.disagree.empty()) *disagree = "mean gradients " + grads.disagree;
  // the balancing biases as gathered (every rank's copy the same bits: the replica check)
  std::vector<float> mesh_bias;
  for (size_t i = table.names.size(); i < table.all_names.size(); i++) {
    const std::vector<float> v = params.full[i].to_vector();
    mesh_bias.insert(mesh_bias.end(), v.begin(), v.end());
  }
  // rank 0: one process from the same weights on the whole global batch, and AdamW on the
  // mesh's own mean gradient
  // the loads the mesh's bias update used, every stage's layers (a pipeline rank counts its own
  // stages' and zeros elsewhere; DualPipe's pair the same: the largest is the count)
  std::vector<float> load = here.load;
  if (comms.pp.size() > 1 && !load.empty()) comms.pp.allreduce(load.data(), (int)load.size(), MPI_FLOAT, MPI_MAX);
  if (lesson.rank() == 0) out.twin = twin.step(lesson, s.step, s.checking, s.last, out.loss_mesh, grads, params, mesh_bias, load);
  return out;
}

Validation validate(Lesson& lesson, OneProcess& twin, CheckComms& comms, RankModel& here,
                    const Setup& setup, const Options& opts, int dp_rank) {
  Trace::Category check_traffic(trace(), "check");  // not training: the trace keeps it apart
  NoGradGuard no_grad;
  // forward only: no routing maps to record (the EP formula reads the training's), restored after
  std::vector<dsv3::RoutingMap>* const maps = here.model.maps;
  here.model.maps = nullptr;
  Validation out;
  const int64_t row0 = (int64_t)dp_rank * setup.rank_batch;
  for (int64_t k = 0; k < opts.val_batches; k++) {
    CharCorpus::Batch vb = setup.corpus.batch(CharCorpus::Split::val, k, opts.batch, setup.seq, row0, row0 + setup.rank_batch,
                                          (uint64_t)lesson.flags.seed);
    vb = {take_columns(vb.inputs, here.my_columns()), take_columns(vb.targets, here.my_columns())};
    double loss = here.stages.forward_only(comms.pp, here.sched, vb.inputs.to(lesson.device), vb.targets.to(lesson.device));
    comms.world.allreduce(&loss, 1, MPI_DOUBLE, MPI_SUM);
    loss /= (double)(comms.dp_cp.size() * setup.sizes.tp);
    if (k == 0) out.first_mesh = loss;
    out.mesh += loss / (double)opts.val_batches;
    if (lesson.rank() == 0) {
      CharCorpus::Batch gb = setup.corpus.batch(CharCorpus::Split::val, k, opts.batch, setup.seq, 0, opts.batch,
                                            (uint64_t)lesson.flags.seed);
      const model::Output o = model::forward(setup.c, twin.model(), gb.inputs.to(lesson.device),
                                             gb.targets.to(lesson.device), model::positions(setup.seq, lesson.device));
      out.one_process += o.loss.item() / (double)opts.val_batches;
      if (opts.precision != "fp32")
        out.token_err += mean_token_error(o.logits, twin.float32_forward(gb.inputs, gb.targets).logits, gb.targets) /
                         (double)opts.val_batches;
    }
  }
  here.model.maps = maps;
  return out;
}

}  // namespace ff::mesh
