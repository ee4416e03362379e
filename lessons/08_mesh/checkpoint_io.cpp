// lessons/08_mesh/checkpoint_io.cpp — a checkpoint's files: see checkpoint_io.h.
#include "lessons/08_mesh/checkpoint_io.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>

#include "common/core/npy.h"
#include "common/layers/tensor_parallel.h"

namespace ff::mesh {

// Every rank's error (the lowest rank's that has one) on every rank; "" when none has.
std::string agree(Comm& world, const std::string& mine) {
  const int has = mine.empty() ? world.size() : world.rank();
  int first = has;
  world.allreduce(&first, 1, MPI_INT, MPI_MIN);
  if (first == world.size()) return "";
  std::string msg = world.rank() == first ? mine : std::string();
  uint64_t n = msg.size();
  world.bcast(&n, sizeof n, first);
  msg.resize(n);
  if (n) world.bcast(&msg[0], n, first);
  return msg;
}

std::string step_name(int64_t steps_done) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%06lld", (long long)steps_done);
  return buf;
}

// The complete checkpoints of dir, oldest (fewest steps) first.
std::vector<Found> complete_checkpoints(const std::string& dir) {
  std::map<int64_t, std::string> by_step;
  std::vector<Found> aside;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      const std::string n = e->d_name;
      const bool replaced = n.rfind(".replaced-step-", 0) == 0;
      if (n.rfind("step-", 0) != 0 && !replaced) continue;
      const std::string digits = n.substr(n.find("step-") + 5);
      if (digits.empty() || digits.size() > 12 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
      if (::access((dir + "/" + n + "/manifest.json").c_str(), R_OK) != 0) continue;
      if (replaced) aside.push_back({n, std::stoll(digits)});
      else by_step[std::stoll(digits)] = n;
    }
    closedir(d);
  }
  for (const Found& f : aside)
    if (!by_step.count(f.step)) by_step[f.step] = f.name;
  std::vector<Found> out;
  for (const auto& [step, name] : by_step) out.push_back({name, step});
  return out;
}

std::string remove_tree(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return errno == ENOENT ? "" : sys_error("cannot stat", path);
  if (S_ISDIR(st.st_mode)) {
    if (DIR* d = opendir(path.c_str())) {
      std::vector<std::string> names;
      while (dirent* e = readdir(d))
        if (std::strcmp(e->d_name, ".") && std::strcmp(e->d_name, "..")) names.push_back(e->d_name);
      closedir(d);
      for (const std::string& n : names) {
        const std::string err = remove_tree(path + "/" + n);
        if (!err.empty()) return err;
      }
    }
    if (::rmdir(path.c_str()) != 0) return sys_error("cannot remove", path);
  } else if (::unlink(path.c_str()) != 0) {
    return sys_error("cannot remove", path);
  }
  return "";
}

std::string fsync_path(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags);
  if (fd < 0) return sys_error("cannot open", path);
  const bool ok = ::fsync(fd) == 0;
  ::close(fd);
  return ok ? "" : sys_error("cannot flush", path);
}

// The checkpoint's files in the model's order: every weight, its m and v, every bias.
std::vector<FileSpec> files_of(const ParamTable& table) {
  std::vector<FileSpec> out;
  for (size_t k = 0; k < table.names.size(); k++) {
    out.push_back({table.names[k], table.full_shapes[k]});
    out.push_back({table.names[k] + ".exp_avg", table.full_shapes[k]});
    out.push_back({table.names[k] + ".exp_avg_sq", table.full_shapes[k]});
  }
  for (size_t k = table.names.size(); k < table.all_names.size(); k++)
    out.push_back({table.all_names[k], table.all_shapes[k]});
  return out;
}

// The CRC-32 (zlib's) of a file's bytes, and its size.
std::string crc_of(const std::string& path, uint32_t* crc, uint64_t* size) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return sys_error("cannot read", path);
  std::vector<unsigned char> buf(1 << 20);
  uLong c = crc32(0L, Z_NULL, 0);
  *size = 0;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), f)) > 0) c = crc32(c, buf.data(), (uInt)n), *size += n;
  const bool bad = std::ferror(f);
  std::fclose(f);
  if (bad) return sys_error("read error in", path);
  *crc = (uint32_t)c;
  return "";
}

Region region_of(const std::string& name, const Shape& full, const MeshCoords& co, const MeshSizes& sizes) {
  const Split s = split_of(name, sizes.ep);
  Region r;
  if (s == Split::replicated) return r;
  if (s == Split::expert) {
    const int64_t per = full[0] / sizes.ep;
    return {0, co.ep * per, (co.ep + 1) * per};
  }
  r.dim = s == Split::column ? 1 : 0;
  split_range(full[(size_t)r.dim], sizes.tp, co.tp, &r.begin, &r.end);
  return r;
}

// [slide:ckpt-runs]
void for_each_run(const Shape& full, const Region& r, int64_t lo, int64_t hi,
                  const std::function<void(int64_t, int64_t, int64_t)>& fn) {
  if (lo >= hi) return;
  if (r.dim <= 0) {  // the whole, or rows [begin, end): contiguous in the full tensor
    const int64_t inner = r.dim < 0 ? 0 : shape_numel(full) / full[0];
    fn(r.dim < 0 ? lo : r.begin * inner + lo, lo, hi - lo);
    return;
  }
  // columns [begin, end) of a matrix: one run per row
  const int64_t cols = full[1], w = r.end - r.begin;
  for (int64_t at = lo; at < hi;) {
    const int64_t row = at / w, col = at % w, n = std::min(hi - at, w - col);
    fn(row * cols + r.begin + col, at, n);
    at += n;
  }
}
// [/slide]

std::string first_model_difference(const model::Config& saved, const model::Config& c) {
  const auto a = model_fields(saved), b = model_fields(c);
  for (size_t i = 0; i < a.size(); i++)
    if (a[i].second != b[i].second)
      return "the checkpoint's model has " + a[i].first + " = " + a[i].second + ", this run's " + b[i].second +
             " (a checkpoint resumes the same model on any mesh)";
  return "";
}

// Every file of `files` against the manifest (whose model is c's): the header (its dtype and shape,
// and where its data start) on every rank, every crc_ranks-th file's CRC-32 on this one. "" or the
// error; *data_offset gets each file's.
std::string check_files(const std::string& dir, const Manifest& m, const std::vector<FileSpec>& files, int crc_rank,
                        int crc_ranks, std::map<std::string, uint64_t>* data_offset) {
  for (size_t i = 0; i < files.size(); i++) {
    const FileSpec& f = files[i];
    const std::string file = dir + "/" + f.file + ".npy";
    const auto entry = m.tensors.find(f.file);
    if (entry == m.tensors.end()) return dir + "/manifest.json: no entry for " + file;
    NpyInfo info;
    try {
      info = read_npy_info(file);
    } catch (const std::exception& e) {
      return e.what();
    }
    if (info.descr != "<f4" || info.shape != f.shape)
      return file + ": holds " + info.descr + " of shape " + nlohmann::json(info.shape).dump() + ", the model's is <f4 of " +
             nlohmann::json(f.shape).dump();
    (*data_offset)[f.file] = info.data_offset;
    if ((int)(i % (size_t)crc_ranks) == crc_rank) {  // the ranks share the CRC-32s, a file each in turn
      uint32_t crc = 0;
      uint64_t size = 0;
      const std::string err = crc_of(file, &crc, &size);
      if (!err.empty()) return err;
      if (size != entry->second.bytes || crc != entry->second.crc32)
        return file + ": checksum mismatch (CRC-32 " + std::to_string(crc) + ", the manifest says " +
               std::to_string(entry->second.crc32) + "): the file is damaged";
    }
  }
  return "";
}

std::string checkpoint_dir(const std::string& path) {
  if (::access((path + "/manifest.json").c_str(), F_OK) == 0) return path;
  const std::vector<Found> done = complete_checkpoints(path);
  return done.empty() ? std::string() : path + "/" + done.back().name;
}

std::string read_checkpoint(Comm& world, const std::string& path, std::string* dir, Manifest* m) {
  *dir = checkpoint_dir(path);
  std::string err = dir->empty() ? path + ": no checkpoint there (no manifest.json, no complete step-* directory)" : "";
  if (err.empty()) err = read_manifest(*dir, m);
  return agree(world, err);
}

std::string checkpoint_model(Comm& world, const std::string& path, model::Config* c) {
  std::string dir;
  Manifest m;
  const std::string err = read_checkpoint(world, path, &dir, &m);
  if (err.empty()) {
    const int64_t seq_len = c->seq_len;  // (not the checkpoint's: a run's)
    *c = m.model;
    c->seq_len = seq_len;
  }
  return err;
}

std::string load_checkpoint_weights(Comm& world, const std::string& path, const model::Config& c,
                                    model::Params* out, Device dev) {
  std::string dir;
  Manifest m;
  std::string err = read_checkpoint(world, path, &dir, &m);
  if (!err.empty()) return err;
  std::vector<FileSpec> files;
  std::map<std::string, uint64_t> data_offset;
  err = first_model_difference(m.model, c);
  if (err.empty()) {
    const model::Params shapes = model::zero_params(c);  // (c is m's model: valid)
    for (const auto& list : {shapes.named_parameters(), shapes.named_buffers()})
      for (const model::NamedTensor& n : list)
        if (n.t.defined()) files.push_back({n.name, n.t.shape()});
    err = check_files(dir, m, files, world.rank(), world.size(), &data_offset);  // the ranks share the CRC-32s
  }
  if (!(err = agree(world, err)).empty()) return err;
  try {
    *out = model::load_params(c, dir, "", dev);
  } catch (const Error& e) {
    err = e.what();
  }
  return agree(world, err);
}

}  // namespace ff::mesh
