// common/lesson/moe_flags.cpp — the MoE lessons' flags and meta.json (moe_flags.h).
#include "common/lesson/moe_flags.h"

#include <cstdio>

#include "common/lesson/lesson.h"

namespace ff::moe {

void add_flags(Cli& cli, Config* c, Flags* f, const std::string& batch_help,
               const std::string& experts_help) {
  cli.flag("--batch", &f->batch, batch_help, 1, 4096);
  cli.flag("--tokens", &f->tokens, "tokens per sequence T", 1, 1 << 16);
  cli.flag("--dim", &c->dim, "model dimension d", 1, 4096);
  cli.flag("--ffn", &c->ffn, "expert hidden dimension f", 1, 16384);
  cli.flag("--experts", &c->experts, experts_help, 1, 1024);
  cli.flag("--topk", &c->topk, "experts per token k (1..N)", 1, 1024);
  cli.choice("--gate", &f->gate, {"softmax-topk", "topk-softmax"},
             "softmax over N then top-k (no renormalisation), or top-k logits then softmax");
  cli.flag("--alpha", &c->alpha, "weight of the load-balance loss", 0.0, 100.0);
  cli.flag("--starve", &f->starve, "give the last S experts router bias -30: they get no tokens",
           0, 1023);
}

void check_flags(const Comm& comm, Config* c, const Flags& f) {
  usage_error_if(c->topk > c->experts, comm,
                 "--topk " + std::to_string(c->topk) + " is more than --experts " +
                     std::to_string(c->experts) + ": k must be in 1..N");
  usage_error_if(f.starve >= c->experts || c->experts - f.starve < c->topk, comm,
                 "--starve " + std::to_string(f.starve) + " leaves " +
                     std::to_string(c->experts - f.starve) + " experts for top-" +
                     std::to_string(c->topk) + ": at least k must stay reachable");
  c->gate = f.gate == "softmax-topk" ? Gate::softmax_topk : Gate::topk_softmax;
}

std::string meta_json(const Config& c, int P, const std::string& extra_fields) {
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "{\"gate\": \"%s\", \"k\": %lld, \"N\": %lld, \"alpha\": %.9g, \"P\": %d, "
                "\"d\": %lld, \"f\": %lld", gate_name(c.gate), (long long)c.topk,
                (long long)c.experts, c.alpha, P, (long long)c.dim, (long long)c.ffn);
  return buf + extra_fields + "}\n";
}

}  // namespace ff::moe
