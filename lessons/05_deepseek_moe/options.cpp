// lessons/05_deepseek_moe/options.cpp — lesson 05's flags (deepseek_moe.h: Flags).
#include "lessons/05_deepseek_moe/deepseek_moe.h"

namespace ff::deepseek {

void declare_flags(Cli& cli, Flags* f) {
  cli.summary("DeepSeek-V3 MoE: sigmoid gate with a balancing bias for selection only, node-limited\n"
              "routing, shared experts, capacity, and a hierarchical (rail, then node) all-to-all,\n"
              "checked against the single-process layer on all ranks' tokens.");
  cli.choice("--gate", &f->gate, {"sigmoid", "softmax"}, "affinity: sigmoid (DeepSeek-V3) or softmax");
  cli.flag("--experts", &f->c.experts, "routed experts N (a multiple of the world size P)", 1, 4096);
  cli.flag("--topk", &f->c.topk, "routed experts per token K", 1, 4096);
  cli.flag("--shared", &f->c.shared, "shared experts S (every token, ungated)", 0, 64);
  cli.flag("--groups", &f->c.groups, "expert groups G (0: one per virtual node)", 0, 4096);
  cli.flag("--topk-groups", &f->c.topk_groups, "groups a token may use M (at most G; with one group, 1)", 1, 4096);
  cli.flag("--group-score-topk", &f->c.group_score_topk,
           "a group's score sums its top this-many biased affinities (capped at N/G; 0: as "
           "DeepSeek's code, 2 with the sigmoid gate, 1 (the group's maximum) with softmax)", 0, 4096);
  cli.flag("--route-scale", &f->c.route_scale, "gates are scaled by this", 0.0, 1000.0);
  cli.flag("--alpha", &f->c.alpha, "weight of the sequence-wise balance loss", 0.0, 100.0);
  cli.choice("--aux-count", &f->aux_count, {"unbiased-topk", "selected"},
             "what the balance loss's f_i counts: each token's top-K of the unbiased affinities "
             "(the report's eq. 18), or the experts the layer selected (biased, group-limited)");
  cli.flag("--batch", &f->batch, "sequences per rank", 1, 4096);
  cli.flag("--tokens", &f->c.seq_len, "tokens per sequence L", 1, 1 << 16);
  cli.flag("--dim", &f->c.dim, "model dimension d", 1, 4096);
  cli.flag("--ffn", &f->c.ffn, "expert hidden dimension f", 1, 16384);
  cli.flag("--bias-init", &f->bias_init, "std of the initial balancing bias b", 0.0, 10.0);
  cli.flag("--ranks-per-node", &f->R, "ranks per node R (must divide P; default: the job's real nodes when it spans several, else virtual nodes of 2 when P is even, of 1 when odd)", 1, 4096);
  cli.flag("--link", &f->link_spec, "model the network: intra=BW,inter=BW,latency=T (e.g. "
           "intra=160GB/s,inter=50GB/s,latency=3us; keys left out take those values) and time "
           "flat against hierarchical under it", "SPEC");
  cli.flag("--reps", &f->reps, "--link: timed repetitions of each all-to-all scheme", 1, 10000);
  cli.choice("--a2a", &f->a2a, {"flat", "hierarchical"},
             "lesson 04's all-to-all, or rail then node (DeepEP's normal kernels)");
  cli.flag("--capacity-factor", &f->c.capacity_factor,
           "C > 0: each expert takes ceil(C T K / N) slots of the T tokens of all ranks "
           "(default: no limit)", 0.0, 1e6);
  cli.choice("--overflow", &f->overflow, {"drop", "next-best"},
             "slots beyond capacity: dropped, or moved to the token's next-best expert with room");
  cli.flag("--train", &f->train.steps, "train a tiny character model this many steps (0: check "
           "the layer once)", 0, 1000000);
  cli.choice("--balance", &f->train.balance, {"none", "aux", "bias"},
             "--train: no balancing, softmax gate + balance loss, or sigmoid gate + the "
             "loss-free bias update");
  cli.flag("--lr", &f->train.lr, "--train: Adam learning rate", 0.0, 10.0);
  cli.flag("--gamma", &f->train.gamma, "--train: bias update speed", 0.0, 10.0);
  cli.flag("--aux-alpha", &f->train.aux_alpha, "--train: balance loss weight with --balance aux",
           0.0, 100.0);
  cli.flag("--seq-alpha", &f->train.seq_alpha, "--train: with --balance bias, the weight of "
           "DeepSeek-V3's sequence-wise balance loss beside the bias (0: the bias alone)", 0.0, 100.0);
  cli.flag("--bias-ema", &f->train.ema, "--train: steer the bias by a smoothed load (0: the "
           "step's own loads, as DeepSeek-V3)", 0.0, 0.999999);
  cli.flag("--log-every", &f->train.log_every, "--train: print every this many steps", 1, 1000000);
  cli.flag("--data", &f->train.data, "--train: the text to train on (the default is the course's data/tinyshakespeare.txt, found from the executable)");
  cli.choice("--bug", &f->bug, {"none", "bias-grad", "no-renorm", "no-shared-grad", "ema-zero-init",
                             "bias-peek"},
             "plant a bug: in the backward, the gate differentiated through s + b, the sigmoid "
             "gate's normalisation forgotten, the shared experts' dx missing; in --train, the "
             "smoothed load starting at 0, the bias updated from the batch it routes");
  cli.epilog("run:  make run L=05 ARGS=\"--a2a flat\"\n"
             "      make run L=05 ARGS=\"--capacity-factor 1 --overflow next-best\"");
}

}  // namespace ff::deepseek
