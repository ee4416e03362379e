// lessons/08_mesh/checkpoint.h — lesson 08's checkpoints: the model written down independently
// of the mesh, saved by every rank at once, resumed on any mesh.
//
// A checkpoint is a directory of numpy files, one per full (unsharded) tensor, and a manifest
// (checkpoint_io.h: the files, and reading them back). A full tensor means the same on any mesh,
// in PyTorch, in numpy; a shard only on the mesh that cut it. Each rank still writes
// only what it owns, straight into the full files at the right offsets (pwrite): rank 0 creates
// every file at its final size with its header, every rank writes its slices (a TP rank its
// columns or rows, an EP rank its experts, a ZeRO rank its block of m and v (ZeRO-3: of the
// weights too), exactly one rank per number: a replicated weight is written by the first rank
// holding it), each flushes its file descriptors (fsync), and rank 0 writes the manifest last.
// Nobody gathers the model.
// Nothing a save does can lose the newest complete checkpoint: all of it goes into
// .tmp-step-NNNNNN, published by one rename to step-NNNNNN once complete and flushed (a rename
// within a directory is atomic). Saving a step that exists already renames the old one aside
// (.replaced-step-NNNNNN) first, and removes it only once the new one is in place; a reader that
// finds only the aside one takes it, and the next save puts it back. --keep K removes only this
// run's lineage's checkpoints (a run from scratch draws a lineage id, a resumed run carries on the
// checkpoint's): the newest K by steps done and this run's last K saves stay; each removed one is
// renamed out of sight before it is deleted. A run from scratch saves only into a directory with
// no checkpoint, a resumed one into a directory holding only its lineage's: another run's
// checkpoints are never pruned, replaced or mixed with this run's (check_save_dir refuses first).
// bf16 weights (lesson 10): their files hold the float32 masters (AdamW's, or the ZeRO shard's),
// which a resumed bf16 run takes as its masters and rounds into its weights; so any precision
// resumes any checkpoint. Resuming reads the same way backwards: each rank reads from the full files only the slices its
// own mesh gives it (any dp, pp, cp, tp, ep, schedule and ZeRO stage), checked against the
// manifest's CRC-32 and shapes first.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/core/optim.h"
#include "common/core/tensor.h"
#include "lessons/08_mesh/zero.h"
#include "common/lesson/lesson.h"
#include "lessons/08_mesh/checkpoint_io.h"
#include "lessons/08_mesh/mesh_model.h"
#include "lessons/08_mesh/options.h"

namespace ff::mesh {

// What a checkpoint holds besides the tensors.
struct CheckpointInfo {
  int64_t steps_done = 0;  // training steps taken; the next step's batch is step steps_done's
  int64_t adam_steps = 0;  // AdamW's t
  double seconds = 0;      // the resume: checked (the CRC-32s shared by the ranks) and read
  uint64_t bytes = 0;      // the checkpoint's files
  std::string dir;         // the step-* directory read
};

// This run's place among checkpoints: its lineage (manifest.h's run) and the steps it saved,
// oldest first (--keep never removes one of its last K).
struct Lineage {
  std::string run;
  std::vector<int64_t> saved;
};

// The optimizer groups whose state a checkpoint holds (lesson 08's dense, replicated, experts).
struct StateGroups {
  std::vector<zero::GroupAdam*> groups;
};

// Collective over the world: writes the checkpoint of the mesh after `steps_done` steps under
// dir/step-NNNNNN (see above) and keeps `keep` of the lineage (0: all). Any failure (a full disk,
// a non-writable directory) is one `error:` line naming the file, exit 2 on every rank, the
// newest complete checkpoint intact.
void save_checkpoint(Lesson& lesson, const std::string& dir, int64_t keep, const Options& opts,
                     const Setup& setup, Mesh& mesh, RankModel& here, const StateGroups& state,
                     Lineage* lineage, int64_t steps_done);

// Collective: "" when the run of lineage `run` may save into dir (it holds no complete checkpoint
// of another lineage), else the error, the same on every rank.
std::string check_save_dir(Comm& world, const std::string& dir, const std::string& run);

// The checkpoint --resume names: the directory itself when it holds a manifest, else its newest
// complete step-* (a --save directory). Collective: reads and checks the manifest and every
// file's CRC-32, shape and the model's configuration against the flags (a mismatch or a
// damaged checkpoint: one `error:` line naming the file or the field, exit 2 on every rank),
// then gives every rank's weights, balancing biases and AdamW state their slices.
CheckpointInfo resume_checkpoint(Lesson& lesson, const std::string& path, const Options& opts,
                                 const Setup& setup, Mesh& mesh, RankModel& here, const StateGroups& state);

}  // namespace ff::mesh
