// lessons/06_overlap/run_result.cpp — the variants of the schedule (run_result.h).
#include "lessons/06_overlap/run_result.h"

namespace ff::f1b {

std::vector<Variant> schedule_variants(const Options& opts, const Setup& setup) {
  const bool prefill = opts.prefill;
  std::vector<Variant> variants;
  auto variant = [&](const std::string& name, Mode mode, bool defer_w) {
    Variant v;
    v.name = name, v.mode = mode, v.defer_w = defer_w;
    v.key = mode == Mode::sequential ? "sequential"
            : prefill                ? "overlapped"
            : defer_w                ? "overlapped-w-in-waits"
                                     : "overlapped-w-inline";
    variants.push_back(v);
  };
  if (opts.mode != "overlapped") variant("sequential", Mode::sequential, false);
  if (opts.mode == "both" && !prefill) variant("overlapped, W inline", Mode::overlapped, false);
  if (opts.mode != "sequential")
    variant(prefill         ? "overlapped"
            : setup.defer_w ? "overlapped, W in waits"
                            : "overlapped, W inline",
            Mode::overlapped, !prefill && setup.defer_w);
  return variants;
}

}  // namespace ff::f1b
