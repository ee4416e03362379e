// lessons/06_overlap/options.h — lesson 06's flags, what they decide (block.h's Setup) and every
// check of them, before any work.
#pragma once
#include <cstdint>
#include <string>

#include "common/comm/comm.h"
#include "common/lesson/lesson.h"
#include "lessons/06_overlap/block.h"

namespace ff::f1b {

// The flags that are not the block's (Setup's), as given; link as parsed from --link.
struct Options {
  // The default machine, modelled: compute at 1 GFLOP/s per rank and links in DeepSeek-V3's
  // ratio (NVLink 160 GB/s : InfiniBand 50 GB/s = 3.2), slowed so that at this toy's size the
  // all-to-alls cost about what the compute does, as in DeepSeek-V3's training (README).
  std::string mode = "both", progress = "test", defer = "yes", bug = "none",
              link_spec = "intra=9.6MB/s,inter=3MB/s,latency=20us", compute = "modelled";
  double gflops = 1.0;
  int64_t ranks_per_node = 2, reps = 2, width = 72;  // width: timeline columns
  bool prefill = false;
  LinkModel link;
};

// Declares the flags on lesson.cli, parses them, checks them against the world size, the
// watchdog and the memory (one error: line, exit 2 on every rank), and returns the block's setup.
Setup parse_options(Lesson& lesson, Options* opts);

}  // namespace ff::f1b
