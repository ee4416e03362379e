// lessons/08_mesh/manifest.h — a checkpoint's manifest: what it holds besides the tensors,
// written by the save last and read back as data, every field checked, never trusted.
//
// manifest.json (format "fivefold lesson 08 checkpoint", version 2):
//   run          the run's lineage: 16 hex digits drawn when a run starts from scratch, carried on
//                by every run that resumes from it (--keep prunes this lineage's checkpoints only)
//   steps_done   training steps taken (the directory's step-NNNNNN); adam_steps AdamW's t (one
//                AdamW step per training step: the same number)
//   seed, batch, seq, data   the data position: step s's batch is drawn from (data, seed, s, batch,
//                seq), and the next step is steps_done's; data is the text's size and CRC-32
//   lr, bias_rate           the optimizer's and the balancing biases' rates (constant: the
//                schedule's position is steps_done)
//   model        every field of model::Config the checkpoint's shapes follow
//   mesh         the mesh it was written from (dp pp cp tp ep, zero, schedule, sp): for the reader,
//                a checkpoint resumes on any mesh
//   tensors      every file NAME.npy: its shape, dtype, bytes and CRC-32
// manifest.crc32, beside it: the CRC-32 of manifest.json's bytes, 8 hex digits and a newline, so
// that an edited manifest is refused (zlib.crc32 in Python gives the same number).
//
// Reading checks every field's type and range, naming the field (model.dim, tensors.embed.bytes),
// then its consistency (steps_done is the directory's step, adam_steps is steps_done, every tensor
// of the model present with the model's shape and no other, the model itself valid), then the
// manifest's own CRC-32: "" or one sentence starting with the manifest's path.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/core/tensor.h"
#include "common/layers/model.h"

namespace ff::mesh {

struct TensorEntry {
  Shape shape;
  uint64_t bytes = 0;  // the file's size (its header, numpy's or longer, and the data)
  uint32_t crc32 = 0;  // zlib's CRC-32 of the file's bytes
};

struct Manifest {
  std::string run;  // 16 lowercase hex digits
  int64_t steps_done = 0, adam_steps = 0;
  int64_t seed = 0, batch = 0, seq = 0;
  double lr = 0, bias_rate = 0;
  uint64_t data_bytes = 0;
  uint32_t data_crc32 = 0;
  model::Config model;
  int64_t dp = 1, pp = 1, cp = 1, tp = 1, ep = 1, zero = 0;
  std::string schedule = "1f1b";
  bool sp = false;
  std::map<std::string, TensorEntry> tensors;  // by file name without .npy
};

constexpr const char* kManifestFormat = "fivefold lesson 08 checkpoint";
constexpr int kManifestVersion = 2;

// The files a checkpoint of model c holds, by name, with their shapes: every weight, its AdamW m
// (NAME.exp_avg) and v (NAME.exp_avg_sq), every balancing bias. Throws ff::Error for an invalid c.
std::map<std::string, Shape> checkpoint_files(const model::Config& c);

// The model fields a manifest records, in its order, each as text ("dim", "64"): for the messages
// that name the first one two models differ in.
std::vector<std::pair<std::string, std::string>> model_fields(const model::Config& c);

// dir/manifest.json and dir/manifest.crc32, written and flushed (fsync); "" or the error naming
// the file.
std::string write_manifest(const std::string& dir, const Manifest& m);

// dir/manifest.json read and checked as above into *out; "" or the error.
std::string read_manifest(const std::string& dir, Manifest* out);

// The run's lineage field alone (for --save's check of a directory): "" or the error.
std::string read_manifest_run(const std::string& dir, std::string* run);

// A fresh lineage: 16 hex digits from the system's entropy.
std::string new_run_id();

// "WHAT PATH: the system's reason" (strerror of errno), for a failed call on PATH.
std::string sys_error(const std::string& what, const std::string& path);

}  // namespace ff::mesh
