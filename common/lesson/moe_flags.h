// common/lesson/moe_flags.h — what lessons 03 and 04 share around the MoE layer of
// common/layers/moe.h: its flags and their checks, and the dump's meta.json.
#pragma once
#include <cstdint>
#include <string>

#include "common/comm/comm.h"
#include "common/layers/moe.h"
#include "common/lesson/cli.h"

namespace ff::moe {

// The layer's flags, the same in lessons 03 and 04: --batch --tokens --dim --ffn --experts
// --topk --gate --alpha --starve. check_flags() runs after parsing: it sets c->gate and
// rejects k > N and a --starve that leaves fewer than k experts (usage errors on every rank).
struct Flags {
  int64_t batch = 2, tokens = 16, starve = 0;
  std::string gate = "softmax-topk";
};
void add_flags(Cli& cli, Config* c, Flags* f, const std::string& batch_help,
               const std::string& experts_help);
void check_flags(const Comm& comm, Config* c, const Flags& f);
// The dump's meta.json (read by tests/check_dump_03.py): the layer's settings, the world size,
// and extra_fields (e.g. `, "a2a": "async"`) before the closing brace.
std::string meta_json(const Config& c, int P, const std::string& extra_fields);

}  // namespace ff::moe
