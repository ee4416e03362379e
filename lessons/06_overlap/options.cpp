// lessons/06_overlap/options.cpp — lesson 06's flags and their checks (options.h).
#include "lessons/06_overlap/options.h"

#include <algorithm>

#include "lessons/06_overlap/timeline.h"

namespace ff::f1b {

Setup parse_options(Lesson& lesson, Options* opts) {
  Setup setup;
  const int ranks = lesson.comm.size();
  dsv3::Config& moe = setup.moe;
  moe.experts = 8, moe.topk = 2, moe.shared = 1, moe.dim = 64, moe.ffn = 128;
  moe.groups = 1, moe.topk_groups = 1;
  moe.route_scale = 1.0, moe.alpha = 0.0;
  std::string &mode = opts->mode, &progress = opts->progress, &defer = opts->defer, &bug = opts->bug,
              &link_spec = opts->link_spec, &compute = opts->compute;
  double& gflops = opts->gflops;
  int64_t &ranks_per_node = opts->ranks_per_node, &reps = opts->reps, &width = opts->width;
  bool& prefill = opts->prefill;
  Cli& cli = lesson.cli;
  cli.summary("1F1B compute/communication overlap: the forward of one micro-batch and the backward\n"
              "of another interleaved so that each one's all-to-alls hide behind the other's\n"
              "compute, timed under a modelled network and checked bit for bit against the\n"
              "sequential run, which is checked against one process.");
  cli.flag("--microbatches", &setup.microbatches,
           "micro-batches M (1F1B: F(0), M-1 steps F(i) & B(i-1), B(M-1))", 1, 4096);
  cli.choice("--mode", &mode, {"sequential", "overlapped", "both"},
             "run the sequential schedule, the overlapped one, or both and compare");
  cli.choice("--progress", &progress, {"none", "test", "thread"},
             "how messages move while the rank computes: only in the waits, MPI_Test between "
             "compute tiles, or a progress thread");
  cli.choice("--defer-w", &defer, {"yes", "no"},
             "overlapped: set the weight gradients aside and run them while a wait would idle");
  cli.flag("--link", &link_spec, "the modelled network: intra=BW,inter=BW,latency=T (keys left "
           "out: DeepSeek-V3's 160 GB/s, 50 GB/s, 3 us)", "SPEC");
  cli.choice("--compute", &compute, {"modelled", "real"},
             "modelled: each compute phase computes, then lasts its FLOPs at --gflops (timings "
             "that hold on a machine with fewer cores than ranks); real: what it takes");
  cli.flag("--gflops", &gflops, "--compute modelled: the modelled compute rate per rank, GFLOP/s",
           1e-3, 1e6);
  cli.flag("--ranks-per-node", &ranks_per_node,
           "ranks per node (must divide P; default: the job's real nodes when it spans several, "
           "else virtual nodes of 2 when P is even, of 1 when odd)", 1, 4096);
  cli.flag("--tokens", &setup.tokens, "tokens per micro-batch per rank T", 1, 1 << 14);
  cli.flag("--dim", &moe.dim, "model dimension d", 1, 4096);
  cli.flag("--heads", &setup.heads, "attention heads H (must divide d)", 1, 4096);
  cli.flag("--experts", &moe.experts, "routed experts N (a multiple of the ranks)", 1, 4096);
  cli.flag("--topk", &moe.topk, "routed experts per token K", 1, 4096);
  cli.flag("--ffn", &moe.ffn, "expert hidden dimension f", 1, 16384);
  cli.flag("--shared", &moe.shared, "shared experts S", 0, 64);
  cli.toggle("--prefill", &prefill,
             "inference: two forward micro-batches interleaved (no backward)");
  cli.flag("--reps", &reps, "timed repetitions of each mode (the fastest is shown)", 1, 1000);
  cli.flag("--width", &width, "columns of rank 0's printed timelines", 16, 400);
  cli.choice("--bug", &bug, {"none", "early-read"},
             "plant a bug: the overlapped step reads the dispatched rows before waiting for them");
  cli.epilog("run:  make run L=06\n"
             "      make run L=06 ARGS=\"--progress none\"\n"
             "      make run L=06 ARGS=\"--prefill\"");
  lesson.parse();
  // the job's real nodes when it spans several, else virtual ones; the link model over them
  const Lesson::Network net = lesson.network(cli.given("--ranks-per-node") ? ranks_per_node : 0,
                                             ranks % 2 == 0 ? 2 : 1, &link_spec);
  ranks_per_node = net.ranks_per_node;
  opts->link = net.link;
  lesson.usage_error_if(ranks % ranks_per_node != 0, "--ranks-per-node " +
                                                         std::to_string(ranks_per_node) +
                                                         " does not divide the " +
                                                         std::to_string(ranks) + " ranks");
  lesson.usage_error_if(moe.experts % ranks != 0, "--experts " + std::to_string(moe.experts) +
                                                      " is not a multiple of the " +
                                                      std::to_string(ranks) +
                                                      " ranks: every rank holds N/P experts");
  lesson.usage_error_if(moe.topk > moe.experts, "--topk " + std::to_string(moe.topk) +
                                                    " is more than the " +
                                                    std::to_string(moe.experts) + " experts");
  lesson.usage_error_if(moe.dim % setup.heads != 0, "--heads " + std::to_string(setup.heads) +
                                                        " does not divide --dim " +
                                                        std::to_string(moe.dim));
  lesson.usage_error_if(bug == "early-read" && mode == "sequential",
                        "--bug early-read plants a bug in the overlapped step: leave out --mode sequential");
  lesson.usage_error_if(progress == "thread" && Comm::thread_level_provided() < MPI_THREAD_SERIALIZED,
                        "--progress thread needs MPI_THREAD_SERIALIZED, and this MPI provides only "
                        "MPI_THREAD_SINGLE or FUNNELED: use --progress test");
  {
    // The longest compute phase, modelled: a rank's experts with every routed row of every
    // rank on them. A peer may wait through a few phases: each must stay well inside the
    // watchdog's --timeout, or the ranks waiting for this one would be reported as deadlocked.
    const double Tn = (double)setup.tokens, dn = (double)moe.dim, fn = (double)moe.ffn;
    const double longest = std::max({8 * Tn * dn * dn + 8 * Tn * Tn * dn,
                                     6 * dn * fn * Tn * (double)(moe.topk * ranks) +
                                         6 * Tn * dn * fn * (double)moe.shared}) / (gflops * 1e9);
    lesson.usage_error_if(compute == "modelled" && longest > 0.25 * lesson.flags.timeout,
                          "--gflops " + fmt_num(gflops) + " makes a compute phase last up to " +
                              fmt_num(longest) + " s, more than a quarter of the watchdog's " +
                              "--timeout (" + fmt_num(lesson.flags.timeout) +
                              " s): raise --gflops or --timeout");
  }
  moe.seq_len = setup.tokens;
  setup.progress = progress == "none"   ? ProgressMode::none
                   : progress == "test" ? ProgressMode::test
                                        : ProgressMode::thread;
  setup.defer_w = defer == "yes";
  setup.modelled_compute = compute == "modelled";
  setup.flops_per_s = gflops * 1e9;
  setup.early_read = bug == "early-read";
  setup.dev = lesson.device;
  setup.seed = (uint64_t)lesson.flags.seed;
  const int64_t T = setup.tokens, d = moe.dim, K = moe.topk, f = moe.ffn;
  // per micro-batch alive at once (two in 1F1B): activations of attention and MoE, with the
  // reference beside them and the parameters
  const double act = 4.0 * (double)T * (12.0 * d + 3.0 * setup.heads * T + K * (4.0 * d + 6.0 * f));
  lesson.require_memory(2.0 * (double)setup.microbatches * act + 4.0 * 6.0 * (4.0 * d * d + 3.0 * moe.experts * d * f),
                        "--microbatches, --tokens, --dim, --ffn or --experts");
  return setup;
}

}  // namespace ff::f1b
