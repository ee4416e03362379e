// lessons/08_mesh/checkpoint.cpp — lesson 08's checkpoints saved and resumed on the mesh (the
// scheme is in checkpoint.h, the files in checkpoint_io.h).
#include "lessons/08_mesh/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <map>

#include "common/core/npy.h"
#include "lessons/08_mesh/fsdp.h"
#include "common/util/files.h"
#include "lessons/08_mesh/formulas.h"

namespace ff::mesh {

namespace {

// What this rank reads or writes of one file: elements [lo, hi) of a local tensor that holds
// `region` of the full tensor, from or into host memory at `host` (its element lo).
struct Piece {
  std::string file;
  Shape full;
  Region region;
  int64_t lo = 0, hi = 0;
  float* host = nullptr;
};

// Where each of this rank's pieces of the checkpoint are, and which it writes (exactly one
// rank per number) — the plan save and resume share. The host buffers live in `store`.
struct Plan {
  std::vector<Piece> pieces;
  std::vector<bool> writes;              // per piece: this rank writes it on save
  std::vector<std::vector<float>> store;  // host copies the pieces point into
  // after a resume: the tensors to fill from store, in order
  std::vector<std::pair<Tensor, size_t>> params;  // (this rank's tensor, its store index)
  // bf16 weights (lesson 10's mixed precision): a checkpoint holds their float32 masters as the
  // weights. ZeRO-0: the store of each whole weight (by its table index), its master on resume;
  // ZeRO-1, -2: each group's shard of them (after m and v), its masters
  std::map<size_t, size_t> whole_of;
  std::vector<std::pair<zero::GroupAdam*, size_t>> master_shards;
};

struct Who {  // this rank, as the writer rules see it
  MeshCoords co;
  MeshSizes sizes;
  int data_rank = 0, edp_rank = 0, pp_rank = 0;
  const StagePlan* plan = nullptr;
  // the copy of a stage that writes it: DualPipe's two copies, the direction-0 one
  bool stage_writer(const std::string& name) const {
    if (!plan->holds(name, pp_rank)) return false;
    return plan->sched.layout != pp::Layout::dual || plan->sched.stage_of(pp_rank, 0) == plan->stage_of(name);
  }
  // a weight (or ZeRO-0's m and v of it): one rank among those holding the same numbers
  bool writes_whole(const std::string& name) const {
    if (!stage_writer(name)) return false;
    const Split s = split_of(name, sizes.ep);
    if (s == Split::expert) return edp_rank == 0;
    return data_rank == 0 && (s != Split::replicated || co.tp == 0);
  }
  // ZeRO-1 and -2's blocks of m and v: every rank of the group holds a different block
  bool writes_block(const std::string& name) const {
    if (!stage_writer(name)) return false;
    const Split s = split_of(name, sizes.ep);
    return s == Split::expert || s != Split::replicated || co.tp == 0;
  }
};

size_t add_store(Plan* p, int64_t n) {
  p->store.emplace_back((size_t)n, 0.f);
  return p->store.size() - 1;
}

// The plan: weights and biases whole per local tensor; m and v per local tensor (ZeRO-0) or per
// run of this rank's shard (ZeRO-1, -2). `fill`: copy the tensors' values into the store (save).
// bf16 weights: the weights' files hold their float32 masters (ZeRO-0: AdamW's, ZeRO-1 and -2:
// written from each rank's shard of them, ZeRO-3: its shard, as in float32), so that a resumed
// run steps on from the same masters, in any precision (float32 resumes them as its weights).
Plan make_plan(const Who& who, RankModel& here, const StateGroups& state, int zero, bool fill) {
  Plan plan;
  const ParamTable& table = here.table;
  auto region = [&](size_t k) { return region_of(table.names[k], table.full_shapes[k], who.co, who.sizes); };
  auto piece = [&](const std::string& file, const Shape& full, Region r, int64_t lo, int64_t hi, size_t s, int64_t at,
                   bool writes) {
    plan.pieces.push_back({file, full, r, lo, hi, plan.store[s].data() + at});
    plan.writes.push_back(writes);
  };
  // the weights: whole local tensors; under ZeRO-3 this rank's shards of them (the tensors are
  // released between uses), run by run
  for (zero::GroupAdam* g : state.groups) {
    fsdp::ShardGroup* shards = zero == 3 ? g->shards() : nullptr;
    if (!shards || g->params.empty()) continue;
    const size_t s = add_store(&plan, shards->shard_size());
    if (fill) plan.store[s] = shards->param_shard().to_vector();
    shards->for_each_shard_run([&](size_t i, int64_t local, int64_t at, int64_t count) {
      const size_t k = g->keys[i];
      piece(table.names[k], table.full_shapes[k], region(k), local, local + count, s, at,
            who.writes_block(table.names[k]));
    });
    plan.params.push_back({shards->param_shard(), s});
  }
  std::map<size_t, const Tensor*> master_of;  // ZeRO-0's masters of bf16 weights, by table index
  bool shard_masters = false;                 // ZeRO-1, -2 over bf16 weights: written from the shards
  for (zero::GroupAdam* g : state.groups)
    for (size_t i = 0; i < g->params.size(); i++) {
      if (g->params[i]->dtype() != DType::bf16) continue;
      if (zero == 0 && g->adam()->has_master(i)) master_of[g->keys[i]] = &g->adam()->master(i);
      if (zero == 1 || zero == 2) shard_masters = true;
    }
  for (size_t k = 0; k < table.names.size() && zero < 3; k++) {
    if (!table.params[k]) continue;
    const Tensor& t = *table.params[k];
    const size_t s = add_store(&plan, t.numel());
    if (fill) plan.store[s] = master_of.count(k) ? master_of[k]->to_vector() : t.to_vector();
    piece(table.names[k], table.full_shapes[k], region(k), 0, t.numel(), s, 0,
          !shard_masters && who.writes_whole(table.names[k]));
    plan.params.push_back({t, s});
    plan.whole_of[k] = s;
  }
  // the balancing biases (every rank of a stage holds them whole)
  std::map<std::string, Tensor> biases;
  for (const model::NamedTensor& b : here.model.weights.named_buffers())
    if (b.t.defined()) biases[b.name] = b.t;
  for (size_t k = table.names.size(); k < table.all_names.size(); k++) {
    auto it = biases.find(table.all_names[k]);
    if (it == biases.end()) continue;
    const size_t s = add_store(&plan, it->second.numel());
    if (fill) plan.store[s] = it->second.to_vector();
    const bool writes = who.stage_writer(table.all_names[k]) && who.data_rank == 0 && who.co.tp == 0 && who.co.ep == 0;
    piece(table.all_names[k], table.all_shapes[k], Region{}, 0, it->second.numel(), s, 0, writes);
    plan.params.push_back({it->second, s});
  }
  // AdamW's m and v
  for (zero::GroupAdam* g : state.groups) {
    if (g->params.empty()) continue;
    Adam* adam = g->adam();
    const bool have = adam && !adam->exp_avg().empty();
    for (int mv = 0; mv < 2; mv++) {
      const char* suffix = mv == 0 ? ".exp_avg" : ".exp_avg_sq";
      if (zero == 0) {
        for (size_t i = 0; i < g->params.size(); i++) {
          const size_t k = g->keys[i];
          const size_t s = add_store(&plan, g->params[i]->numel());
          if (fill && have) plan.store[s] = (mv == 0 ? adam->exp_avg() : adam->exp_avg_sq())[i].to_vector();
          piece(table.names[k] + suffix, table.full_shapes[k], region(k), 0, g->params[i]->numel(), s, 0,
                who.writes_whole(table.names[k]));
        }
      } else {
        const auto runs = [&](const std::function<void(size_t, int64_t, int64_t, int64_t)>& fn) {
          if (zero == 3) g->shards()->for_each_shard_run(fn);
          else g->sharded()->buckets().for_each_shard_run(fn);
        };
        const int64_t shard = zero == 3 ? g->shards()->shard_size() : g->sharded()->buckets().shard_size();
        const size_t s = add_store(&plan, shard);
        if (fill && have) plan.store[s] = (mv == 0 ? adam->exp_avg() : adam->exp_avg_sq())[0].to_vector();
        runs([&](size_t i, int64_t local, int64_t at, int64_t count) {
          const size_t k = g->keys[i];
          piece(table.names[k] + suffix, table.full_shapes[k], region(k), local, local + count, s, at,
                who.writes_block(table.names[k]));
        });
      }
    }
  }
  // ZeRO-1 and -2 over bf16 weights: the weights' files from each rank's shard of the masters
  // (before the first step, of the weights themselves, widened: the masters they start from)
  for (zero::GroupAdam* g : state.groups) {
    if (!shard_masters || g->params.empty()) continue;
    zero::ShardedAdam* z = g->sharded();
    const size_t s = add_store(&plan, z->shard_size());
    if (fill && z->masters_held()) plan.store[s] = z->param_shard().to_vector();
    z->buckets().for_each_shard_run([&](size_t i, int64_t local, int64_t at, int64_t count) {
      const size_t k = g->keys[i];
      if (fill && !z->masters_held()) {
        const std::vector<float> w = g->params[i]->to_vector();
        std::copy(w.begin() + local, w.begin() + local + count, plan.store[s].begin() + at);
      }
      piece(table.names[k], table.full_shapes[k], region(k), local, local + count, s, at, who.writes_block(table.names[k]));
    });
    plan.master_shards.push_back({g, s});
  }
  return plan;
}

Who who_am_i(Mesh& mesh, RankModel& here, const Setup& setup) {
  Who w;
  w.co = mesh.coords(), w.sizes = setup.sizes;
  w.data_rank = mesh.dp_cp().rank(), w.edp_rank = mesh.edp().rank(), w.pp_rank = here.pp_rank;
  w.plan = &here.plan;
  return w;
}

// pwrite / pread every run of the pieces, file by file. write: the writer's pieces only.
// full_disk: every write fails as on a full disk (ENOSPC, as /dev/full's do): the test's.
std::string transfer(const std::string& dir, const Plan& plan, bool write,
                     const std::map<std::string, uint64_t>& data_offset, bool full_disk = false,
                     const std::function<void(const char*)>& point = nullptr) {
  std::map<std::string, int> fds;
  std::string err;
  for (size_t i = 0; i < plan.pieces.size() && err.empty(); i++) {
    if (write && !plan.writes[i]) continue;
    const Piece& p = plan.pieces[i];
    const std::string path = dir + "/" + p.file + ".npy";
    int& fd = fds[p.file];
    if (fd == 0) {
      fd = ::open(path.c_str(), write ? O_WRONLY : O_RDONLY);
      if (fd < 0) {
        err = sys_error("cannot open", path);
        fd = -1;
        break;
      }
    }
    const uint64_t base = data_offset.at(p.file);
    for_each_run(p.full, p.region, p.lo, p.hi, [&](int64_t full_at, int64_t local_at, int64_t count) {
      if (!err.empty()) return;
      char* mem = reinterpret_cast<char*>(p.host + (local_at - p.lo));
      size_t left = (size_t)count * sizeof(float);
      off_t off = (off_t)(base + (uint64_t)full_at * sizeof(float));
      while (left > 0) {
        ssize_t n = write ? (full_disk ? -1 : ::pwrite(fd, mem, left, off)) : ::pread(fd, mem, left, off);
        if (write && full_disk) errno = ENOSPC;
        if (n <= 0) {
          if (n < 0 && errno == EINTR) continue;
          if (n == 0) errno = write ? ENOSPC : EIO;
          err = sys_error(write ? "cannot write" : "cannot read", path);
          return;
        }
        mem += n, left -= (size_t)n, off += n;
      }
    });
  }
  if (write && err.empty() && point) point("fsync");
  for (auto& [file, fd] : fds) {
    if (fd <= 0) continue;
    if (write && err.empty() && ::fsync(fd) != 0) err = sys_error("cannot flush", dir + "/" + file + ".npy");
    ::close(fd);
  }
  return err;
}

}  // namespace



namespace {

// For the tests of a crash and of a full disk during a save (tests/lessons/test_08_checkpoint.py):
// FF_TEST_KILL_IN_SAVE=R:S[:POINT] kills rank R with SIGKILL when it reaches POINT of the save
// after S steps (default: written, its slices written and flushed); FF_TEST_FULL_DISK_IN_SAVE=R:S
// makes rank R's writes of that checkpoint fail as on a full disk (ENOSPC). The points, in order
// (rank 0's but write, fsync and written, every rank's): tidy, mkdir, create, write, fsync,
// written, manifest, fsync-tmp, aside, publish, remove-aside, prune, prune-remove.
bool test_hook(const char* name, int rank, int64_t steps, const char* point) {
  const char* at = std::getenv(name);
  int r = -1;
  long long s = -1;
  char where[64] = "written";
  return at && std::sscanf(at, "%d:%lld:%63s", &r, &s, where) >= 2 && r == rank && s == steps &&
         std::strcmp(where, point) == 0;
}

struct SavePoints {
  int rank;
  int64_t steps;
  void operator()(const char* point) const {
    if (test_hook("FF_TEST_KILL_IN_SAVE", rank, steps, point)) ::raise(SIGKILL);
  }
};

// What an interrupted save left in dir, put right (rank 0, at the start of the next save): a
// checkpoint set aside by a replacement goes back where it was when its replacement never
// arrived, and is removed when it did; half-written and half-removed directories go.
std::string tidy(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) names.push_back(e->d_name);
    closedir(d);
  }
  std::string err;
  for (const std::string& n : names) {
    if (!err.empty()) break;
    const std::string path = dir + "/" + n;
    if (n.rfind(".replaced-", 0) == 0) {
      const std::string home = dir + "/" + n.substr(std::strlen(".replaced-"));
      if (::access(home.c_str(), F_OK) == 0) err = remove_tree(path);
      else if (::rename(path.c_str(), home.c_str()) != 0) err = sys_error("cannot rename into", home);
    } else if (n.rfind(".tmp-step-", 0) == 0 || n.rfind(".removing-step-", 0) == 0) {
      err = remove_tree(path);
    }
  }
  return err;
}

// Keep --keep K of this run's lineage: the newest K by steps done and this run's last K saves;
// the lineage's others go (renamed out of sight first, so that a crash while removing one never
// leaves a half checkpoint that looks complete). Other runs' checkpoints are never touched.
std::string prune(const std::string& dir, int64_t keep, const Lineage& lineage, const SavePoints& point) {
  if (keep <= 0) return "";
  std::vector<Found> ours;
  for (const Found& f : complete_checkpoints(dir)) {
    std::string run;
    if (read_manifest_run(dir + "/" + f.name, &run).empty() && run == lineage.run) ours.push_back(f);
  }
  std::vector<int64_t> kept(lineage.saved.end() - std::min(lineage.saved.size(), (size_t)keep), lineage.saved.end());
  for (size_t i = ours.size() - std::min(ours.size(), (size_t)keep); i < ours.size(); i++) kept.push_back(ours[i].step);
  for (const Found& f : ours) {
    if (std::find(kept.begin(), kept.end(), f.step) != kept.end()) continue;
    point("prune");
    const std::string out_of_sight = dir + "/.removing-" + step_name(f.step);
    if (::rename((dir + "/" + f.name).c_str(), out_of_sight.c_str()) != 0) return sys_error("cannot rename", dir + "/" + f.name);
    point("prune-remove");
    const std::string err = remove_tree(out_of_sight);
    if (!err.empty()) return err;
  }
  return "";
}

// Publishes the complete directory tmp as final: one rename when final is new; when it replaces
// one, the old is renamed aside first and removed after, so that at every moment the step has a
// complete directory (tidy and complete_checkpoints find an aside one whose successor never came).
std::string publish(const std::string& dir, const std::string& tmp, const std::string& final_dir, int64_t steps,
                    const SavePoints& point) {
  // [slide:ckpt-publish]
  const std::string aside = dir + "/.replaced-" + step_name(steps);
  const bool replaces = ::access(final_dir.c_str(), F_OK) == 0;
  if (replaces) {  // set aside, not removed: the step always has a complete directory
    point("aside");
    if (std::string err = remove_tree(aside); !err.empty()) return err;
    if (::rename(final_dir.c_str(), aside.c_str()) != 0) return sys_error("cannot rename", final_dir);
  }
  point("publish");
  if (::rename(tmp.c_str(), final_dir.c_str()) != 0) return sys_error("cannot rename into", final_dir);
  if (std::string err = fsync_path(dir, O_RDONLY | O_DIRECTORY); !err.empty()) return err;
  point("remove-aside");
  return replaces ? remove_tree(aside) : "";
  // [/slide:ckpt-publish]
}

}  // namespace

void save_checkpoint(Lesson& lesson, const std::string& dir, int64_t keep, const Options& opts,
                     const Setup& setup, Mesh& mesh, RankModel& here, const StateGroups& state,
                     Lineage* lineage, int64_t steps_done) {
  Trace::Category check_traffic(trace(), "check");  // not training: the trace keeps it apart
  const Stopwatch watch;
  Comm& world = lesson.comm;
  const bool root = world.rank() == 0;
  const SavePoints point{world.rank(), steps_done};
  const std::vector<FileSpec> files = files_of(here.table);
  const std::string tmp = dir + "/.tmp-" + step_name(steps_done), final_dir = dir + "/" + step_name(steps_done);
  std::map<std::string, uint64_t> data_offset;
  for (const FileSpec& f : files) data_offset[f.file] = npy_header("<f4", f.shape).size();
  // 1. rank 0: the directory, and every file at its size with its header
  std::string err;
  if (root) {
    err = check_output_path(dir, PathKind::dir);
    if (err.empty()) point("tidy");
    if (err.empty()) err = tidy(dir);
    if (err.empty()) point("mkdir");
    if (err.empty() && ::mkdir(tmp.c_str(), 0755) != 0) err = sys_error("cannot create", tmp);
    if (err.empty()) point("create");
    for (size_t i = 0; i < files.size() && err.empty(); i++) {
      const std::string path = tmp + "/" + files[i].file + ".npy";
      const std::string header = npy_header("<f4", files[i].shape);
      const int fd = ::open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0644);
      if (fd < 0) {
        err = sys_error("cannot create", path);
        break;
      }
      if (::write(fd, header.data(), header.size()) != (ssize_t)header.size() ||
          ::ftruncate(fd, (off_t)(header.size() + (size_t)shape_numel(files[i].shape) * sizeof(float))) != 0)
        err = sys_error("cannot write", path);
      ::close(fd);
    }
  }
  err = agree(world, err);
  lesson.usage_error_if(!err.empty(), "--save: " + err);
  // 2. every rank: its slices, straight into the files, flushed
  Plan plan = make_plan(who_am_i(mesh, here, setup), here, state, (int)opts.zero, /*fill=*/true);
  point("write");
  err = transfer(tmp, plan, /*write=*/true, data_offset,
                 test_hook("FF_TEST_FULL_DISK_IN_SAVE", world.rank(), steps_done, "written"), point);
  point("written");
  err = agree(world, err);
  lesson.usage_error_if(!err.empty(), "--save: " + err);
  // 3. rank 0: the manifest last, then the rename that makes it visible, then the lineage's old ones go
  if (root) {
    Manifest m;
    m.run = lineage->run, m.steps_done = steps_done;
    for (zero::GroupAdam* g : state.groups)
      if (g->adam() && !g->params.empty()) m.adam_steps = std::max(m.adam_steps, g->adam()->steps());
    m.seed = lesson.flags.seed, m.batch = opts.batch, m.seq = setup.seq, m.lr = opts.lr, m.bias_rate = opts.bias_rate;
    m.data_bytes = (uint64_t)setup.corpus.size(), m.data_crc32 = setup.corpus.crc32();
    m.model = setup.c;
    m.dp = setup.sizes.dp, m.pp = setup.sizes.pp, m.cp = setup.sizes.cp, m.tp = setup.sizes.tp, m.ep = setup.sizes.ep;
    m.zero = opts.zero, m.schedule = opts.schedule, m.sp = opts.sp;
    for (const FileSpec& f : files) {
      if (!err.empty()) break;
      TensorEntry& t = m.tensors[f.file];
      t.shape = f.shape;
      err = crc_of(tmp + "/" + f.file + ".npy", &t.crc32, &t.bytes);
    }
    if (err.empty()) point("manifest");
    if (err.empty()) err = write_manifest(tmp, m);
    if (err.empty()) point("fsync-tmp");
    if (err.empty()) err = fsync_path(tmp, O_RDONLY | O_DIRECTORY);
    if (err.empty()) err = publish(dir, tmp, final_dir, steps_done, point);
    if (err.empty()) {
      lineage->saved.push_back(steps_done);
      err = prune(dir, keep, *lineage, point);
    }
  }
  err = agree(world, err);
  lesson.usage_error_if(!err.empty(), "--save: " + err);
  uint64_t bytes = 0;
  for (const FileSpec& f : files) bytes += data_offset[f.file] + (uint64_t)shape_numel(f.shape) * sizeof(float);
  const double s = watch.seconds();
  lesson.print("checkpoint after %lld steps: %s (%zu files, %s) in %.1f ms, %.0f MB/s\n", (long long)steps_done,
               final_dir.c_str(), files.size() + 2, human_bytes((double)bytes).c_str(), s * 1e3, (double)bytes / s / 1e6);
}


std::string check_save_dir(Comm& world, const std::string& dir, const std::string& run) {
  std::string err;
  if (world.rank() == 0) {
    std::vector<std::string> others;
    std::string their_run;
    for (const Found& f : complete_checkpoints(dir)) {
      std::string r;
      const std::string bad = read_manifest_run(dir + "/" + f.name, &r);
      if (!bad.empty()) {
        err = dir + " holds " + f.name + " whose lineage cannot be read (" + bad + "): a run saves only into a directory of its own checkpoints";
        break;
      }
      if (r != run) others.push_back(f.name), their_run = r;
    }
    if (err.empty() && !others.empty())
      err = dir + " holds another run's checkpoints (" + others.front() + (others.size() > 1 ? " ... " + others.back() : "") +
            ", run " + their_run + "; this run is " + run + "): save into a new directory, or go on from that run with --resume " + dir;
  }
  return agree(world, err);
}

CheckpointInfo resume_checkpoint(Lesson& lesson, const std::string& path, const Options& opts,
                                 const Setup& setup, Mesh& mesh, RankModel& here, const StateGroups& state) {
  const Stopwatch watch;
  Comm& world = lesson.comm;
  const std::vector<FileSpec> files = files_of(here.table);
  std::string dir;
  Manifest m;
  std::string err = read_checkpoint(world, path, &dir, &m);
  lesson.usage_error_if(!err.empty(), "--resume: " + err);
  // every rank checks every file's header, and every P-th file's CRC-32
  std::map<std::string, uint64_t> data_offset;
  err = first_model_difference(m.model, setup.c);
  if (err.empty()) err = check_files(dir, m, files, world.rank(), world.size(), &data_offset);
  err = agree(world, err);
  lesson.usage_error_if(!err.empty(), "--resume: " + err);
  CheckpointInfo info;
  info.steps_done = m.steps_done;
  info.adam_steps = m.adam_steps;
  info.dir = dir;
  lesson.usage_error_if(opts.steps > 0 && info.steps_done > opts.steps,
                        "--resume: the checkpoint has " + std::to_string(info.steps_done) + " steps done, more than --train " +
                            std::to_string(opts.steps) + " (--train counts every step, those before the checkpoint too)");
  // every rank: its slices, into its weights, biases and AdamW state
  Plan plan = make_plan(who_am_i(mesh, here, setup), here, state, (int)opts.zero, /*fill=*/false);
  err = agree(world, transfer(dir, plan, /*write=*/false, data_offset));
  lesson.usage_error_if(!err.empty(), "--resume: " + err);
  for (auto& [t, s] : plan.params) {  // (a bf16 weight: its master rounded to nearest even)
    Tensor target = t, v = Tensor::from_vector(plan.store[s], t.shape());
    target.detach().copy_from((t.dtype() == DType::f32 ? v : v.to_dtype(t.dtype())).to(t.device()));
  }
  {  // the m and v pieces come after the weights' and biases', group by group
    size_t s = plan.params.size();
    for (zero::GroupAdam* g : state.groups) {
      if (g->params.empty()) continue;
      std::vector<Tensor> mv[2];
      for (int k = 0; k < 2; k++) {
        if (opts.zero == 0) {
          for (Tensor* p : g->params) mv[k].push_back(Tensor::from_vector(plan.store[s++], p->shape(), p->device()));
        } else {
          const int64_t shard = opts.zero == 3 ? g->shards()->shard_size() : g->sharded()->buckets().shard_size();
          mv[k].push_back(Tensor::from_vector(plan.store[s++], {shard}));
        }
      }
      std::vector<Tensor> masters;  // ZeRO-0's bf16 weights: the checkpoint's values, unrounded
      for (size_t i = 0; i < g->params.size() && opts.zero == 0; i++)
        masters.push_back(g->params[i]->dtype() != DType::bf16 ? Tensor()
                          : Tensor::from_vector(plan.store[plan.whole_of.at(g->keys[i])], g->params[i]->shape(),
                                                g->params[i]->device()));
      g->adam()->restore(mv[0], mv[1], info.adam_steps, masters);
    }
  }
  for (auto& [g, s] : plan.master_shards)  // ZeRO-1, -2's: each rank's blocks of the masters
    g->sharded()->restore_masters(Tensor::from_vector(plan.store[s], {g->sharded()->shard_size()}));
  world.barrier();  // every rank has read its slices
  info.seconds = watch.seconds();
  for (const FileSpec& f : files) info.bytes += m.tensors.at(f.file).bytes;
  return info;
}


}  // namespace ff::mesh
