// lessons/08_mesh/checkpoint_io.h — a lesson 08 checkpoint's files, for whoever reads or writes
// them: the directory's layout, the slices of the full tensors a rank's tensors are, the checks
// of the files against the manifest, and the whole model read back (lesson 09 serves it). What
// a save and a resume do with them on the mesh is checkpoint.h's.
//
// A checkpoint is a directory, step-NNNNNN, of numpy files, one per FULL (unsharded) tensor:
//   NAME.npy             every weight, by its stable name (model::Params::named_parameters)
//   NAME.exp_avg.npy     AdamW's m for it, NAME.exp_avg_sq.npy its v (PyTorch's names)
//   BIAS.npy             every MoE layer's balancing bias (named_buffers)
//   manifest.json        the run's lineage, the steps done, AdamW's step count, the data position
//                        (seed, batch, seq and the text), the rates, the model's configuration, the
//                        mesh it was written from, and every file's shape, dtype, bytes and CRC-32;
//                        manifest.crc32 its own CRC-32 (manifest.h: every field is checked on reading)
// Why full tensors and not each rank's shards: a shard only means something on the mesh that
// cut it; a full tensor means the same on any mesh, in PyTorch, in numpy. The data of a file
// start where its own header ends (a file rewritten by numpy or another writer with a longer
// header reads the same).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "common/comm/comm.h"
#include "common/core/tensor.h"
#include "common/layers/model.h"
#include "lessons/08_mesh/manifest.h"
#include "lessons/08_mesh/sharding.h"

namespace ff::mesh {

// ---- the directory

// "step-NNNNNN", the directory of the checkpoint after steps_done steps.
std::string step_name(int64_t steps_done);

// A complete checkpoint of a --save directory: step-NNNNNN with its manifest, or, when a save
// that replaced step-NNNNNN stopped between its two renames, the previous one set aside as
// .replaced-step-NNNNNN (step-NNNNNN missing).
struct Found {
  std::string name;
  int64_t step = 0;
};

// The complete checkpoints of dir, oldest (fewest steps) first.
std::vector<Found> complete_checkpoints(const std::string& dir);

// The checkpoint directory a path names: the path itself when it holds a manifest, else the
// newest complete step-* under it (a --save directory); "" when neither.
std::string checkpoint_dir(const std::string& path);

// path removed with everything under it (nothing there: fine); "" or the error naming the file.
std::string remove_tree(const std::string& path);
// fsync of path opened with flags (a file, or O_RDONLY | O_DIRECTORY); "" or the error.
std::string fsync_path(const std::string& path, int flags);

// ---- the files

// One file of a checkpoint: its name in the directory (without .npy) and full shape.
struct FileSpec {
  std::string file;
  Shape shape;
};
// The checkpoint's files in the model's order: every weight, its m and v, every bias.
std::vector<FileSpec> files_of(const ParamTable& table);

// The CRC-32 (zlib's) of a file's bytes, and its size; "" or the error.
std::string crc_of(const std::string& path, uint32_t* crc, uint64_t* size);

// Where in a full tensor a rank's tensor sits: the whole (dim -1), or [begin, end) along dim.
struct Region {
  int dim = -1;
  int64_t begin = 0, end = 0;
};
Region region_of(const std::string& name, const Shape& full, const MeshCoords& co, const MeshSizes& sizes);
// fn(full_at, local_at, count) for the runs of a local tensor's elements [lo, hi) that are
// contiguous in the full tensor (row-major both): one run for a whole tensor or a split along
// dim 0, one per row for columns.
void for_each_run(const Shape& full, const Region& r, int64_t lo, int64_t hi,
                  const std::function<void(int64_t, int64_t, int64_t)>& fn);

// ---- reading one back

// Every rank's error (the lowest rank's that has one) on every rank; "" when none has.
// Collective over world.
std::string agree(Comm& world, const std::string& mine);

// Collective: the checkpoint path names (checkpoint_dir) into *dir, its manifest read and checked
// (manifest.h) into *m; "" or the error naming the file and the field, the same on every rank.
std::string read_checkpoint(Comm& world, const std::string& path, std::string* dir, Manifest* m);

// "" when the checkpoint's model is c, else the message naming the first field that differs.
std::string first_model_difference(const model::Config& saved, const model::Config& c);

// Every file of `files` against the manifest m of dir: the header (its dtype and shape, and where
// its data start, into *data_offset) on every rank, and every crc_ranks-th file's CRC-32 from
// crc_rank's on (the ranks share them). "" or the error naming the file.
std::string check_files(const std::string& dir, const Manifest& m, const std::vector<FileSpec>& files, int crc_rank,
                        int crc_ranks, std::map<std::string, uint64_t>* data_offset);

// The model a checkpoint holds, from its manifest (the newest step-* of a --save directory):
// every field the manifest records (model_fields); c->seq_len is left as it was. Collective over world: ""
// or the error line, the same on every rank.
std::string checkpoint_model(Comm& world, const std::string& path, model::Config* c);
// A checkpoint's weights whole, on every rank of world (lesson 09 serves the model lesson 08
// trained): the manifest checked against c as --resume checks it (format, version, every field
// of the model), every weight's and balancing bias's shape, the CRC-32s shared by the ranks,
// then read into *out (model::load_params). Collective: "" or the error line (naming the file
// or the field), the same on every rank; AdamW's state is not read.
std::string load_checkpoint_weights(Comm& world, const std::string& path, const model::Config& c,
                                    model::Params* out, Device dev = Device::cpu);

}  // namespace ff::mesh
