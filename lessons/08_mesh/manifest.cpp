// lessons/08_mesh/manifest.cpp — a checkpoint's manifest written, and read back as data: every
// field's type and range, then its consistency with the directory, the files and the model, then
// the manifest's own CRC-32 (manifest.h).
#include "lessons/08_mesh/manifest.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "common/core/check.h"
#include "common/util/files.h"
#include "lessons/08_mesh/estimate.h"

namespace ff::mesh {

namespace {

using json = nlohmann::json;

constexpr size_t kMaxManifestBytes = 64u << 20;  // a manifest of a few hundred tensors is ~50 kB

// The manifest's top-level fields, each once; nothing else.
const char* const kFields[] = {"format", "version", "run",   "steps_done", "adam_steps", "seed",  "batch",
                               "seq",    "lr",      "bias_rate", "data",   "model",      "mesh",  "tensors"};

// Every check of a field is one sentence naming the file and the field. The first failure stops
// the reading: throw Bad, caught once in read_manifest.
struct Bad {
  std::string what;
};

class Reader {
 public:
  explicit Reader(std::string path) : path_(std::move(path)) {}

  [[noreturn]] void fail(const std::string& field, const std::string& what) const {
    throw Bad{path_ + ": field " + field + ": " + what};
  }
  static std::string shown(const json& v) {
    std::string s = v.dump();
    return s.size() > 60 ? s.substr(0, 60) + "..." : s;
  }
  const json& at(const json& obj, const std::string& key, const std::string& field) const {
    if (!obj.contains(key)) fail(field, "missing");
    return obj.at(key);
  }
  const json& object(const json& obj, const std::string& key, const std::string& field) const {
    const json& v = at(obj, key, field);
    if (!v.is_object()) fail(field, "expected an object, found " + shown(v));
    return v;
  }
  // An integer (JSON's, not a float that happens to be whole) in [lo, hi].
  int64_t integer(const json& v, const std::string& field, int64_t lo, int64_t hi) const {
    const std::string want = "expected an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], found ";
    if (v.is_number_unsigned()) {
      const uint64_t u = v.get<uint64_t>();
      if (u > (uint64_t)hi) fail(field, want + shown(v));
      return (int64_t)u;
    }
    if (!v.is_number_integer()) fail(field, want + shown(v));
    const int64_t i = v.get<int64_t>();
    if (i < lo || i > hi) fail(field, want + shown(v));
    return i;
  }
  int64_t integer(const json& obj, const std::string& key, const std::string& field, int64_t lo, int64_t hi) const {
    return integer(at(obj, key, field), field, lo, hi);
  }
  uint32_t crc(const json& obj, const std::string& key, const std::string& field) const {
    return (uint32_t)integer(obj, key, field, 0, 0xffffffffLL);
  }
  // A finite number in [lo, hi] (an integer is a number too).
  double number(const json& obj, const std::string& key, const std::string& field, double lo, double hi) const {
    const json& v = at(obj, key, field);
    const double x = v.is_number() ? v.get<double>() : NAN;
    if (!std::isfinite(x) || x < lo || x > hi) {
      char buf[96];
      std::snprintf(buf, sizeof buf, "expected a number in [%g, %g], found ", lo, hi);
      fail(field, buf + shown(v));
    }
    return x;
  }
  std::string string(const json& obj, const std::string& key, const std::string& field) const {
    const json& v = at(obj, key, field);
    if (!v.is_string()) fail(field, "expected a string, found " + shown(v));
    return v.get<std::string>();
  }
  bool boolean(const json& obj, const std::string& key, const std::string& field) const {
    const json& v = at(obj, key, field);
    if (!v.is_boolean()) fail(field, "expected true or false, found " + shown(v));
    return v.get<bool>();
  }
  // Every key of obj is one of `known`.
  void only(const json& obj, const std::set<std::string>& known, const std::string& prefix) const {
    for (auto it = obj.begin(); it != obj.end(); ++it)
      if (!known.count(it.key())) fail(prefix + it.key(), "not a field of this format (a newer writer's, or an edit)");
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// The model's fields, with the ranges lesson 08's flags allow (vocab: the bytes of a text).
struct IntField {
  const char* name;
  int64_t model::Config::*field;
  int64_t lo, hi;
};
const IntField kModelInts[] = {
    {"vocab", &model::Config::vocab, 2, 256},          {"dim", &model::Config::dim, 1, 4096},
    {"layers", &model::Config::layers, 1, 64},         {"dense_layers", &model::Config::dense_layers, 0, 64},
    {"heads", &model::Config::heads, 1, 256},          {"d_nope", &model::Config::d_nope, 1, 1024},
    {"d_rope", &model::Config::d_rope, 2, 1024},       {"d_v", &model::Config::d_v, 1, 1024},
    {"q_lora", &model::Config::q_lora, 1, 4096},       {"kv_lora", &model::Config::kv_lora, 1, 4096},
    {"ffn", &model::Config::ffn, 1, 16384},            {"experts", &model::Config::experts, 1, 256},
    {"topk", &model::Config::topk, 1, 256},            {"shared", &model::Config::shared, 0, 16},
    {"moe_ffn", &model::Config::moe_ffn, 1, 16384}};

json model_json(const model::Config& c) {
  json j;
  for (const IntField& f : kModelInts) j[f.name] = c.*f.field;
  j["route_scale"] = c.route_scale, j["rope_theta"] = c.rope_theta, j["norm_eps"] = c.norm_eps;
  return j;
}

model::Config model_from(const Reader& r, const json& j) {
  std::set<std::string> known = {"route_scale", "rope_theta", "norm_eps"};
  model::Config c;
  for (const IntField& f : kModelInts) {
    c.*f.field = r.integer(j, f.name, std::string("model.") + f.name, f.lo, f.hi);
    known.insert(f.name);
  }
  c.route_scale = r.number(j, "route_scale", "model.route_scale", 1e-6, 1e6);
  c.rope_theta = (float)r.number(j, "rope_theta", "model.rope_theta", 1.0, 1e9);
  c.norm_eps = (float)r.number(j, "norm_eps", "model.norm_eps", 1e-30, 1.0);
  r.only(j, known, "model.");
  return c;
}

std::string crc_hex(uint32_t crc) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08x", crc);
  return buf;
}

uint32_t crc_of_text(const std::string& text) {
  return (uint32_t)crc32(crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(text.data()), (uInt)text.size());
}

// A whole small file into *text; "" or the error.
std::string slurp(const std::string& path, std::string* text, size_t limit) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return sys_error("cannot read", path);
  text->clear();
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0 && text->size() <= limit) text->append(buf, n);
  const bool bad = std::ferror(f);
  std::fclose(f);
  if (bad) return sys_error("read error in", path);
  if (text->size() > limit) return path + ": larger than " + std::to_string(limit >> 20) + " MiB: not a manifest";
  return "";
}

// The step NNNNNN of a directory named step-NNNNNN (or .replaced-step-NNNNNN), else -1.
int64_t step_of_dir(const std::string& dir) {
  std::string base = dir;
  while (base.size() > 1 && base.back() == '/') base.pop_back();
  base = base.substr(base.find_last_of('/') == std::string::npos ? 0 : base.find_last_of('/') + 1);
  const size_t at = base.rfind("step-");
  if (at == std::string::npos || (at != 0 && base.compare(0, at, ".replaced-") != 0)) return -1;
  const std::string digits = base.substr(at + 5);
  if (digits.empty() || digits.size() > 12 || digits.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stoll(digits);
}

bool is_run_id(const std::string& s) {
  return s.size() == 16 && s.find_first_not_of("0123456789abcdef") == std::string::npos;
}

}  // namespace

std::string sys_error(const std::string& what, const std::string& path) {
  return what + " " + path + ": " + std::strerror(errno);
}

std::map<std::string, Shape> checkpoint_files(const model::Config& c) {
  const model::Params shapes = model::zero_params(c);
  std::map<std::string, Shape> out;
  for (const model::NamedTensor& n : shapes.named_parameters()) {
    out[n.name] = n.t.shape();
    out[n.name + ".exp_avg"] = n.t.shape();
    out[n.name + ".exp_avg_sq"] = n.t.shape();
  }
  for (const model::NamedTensor& n : shapes.named_buffers())
    if (n.t.defined()) out[n.name] = n.t.shape();
  return out;
}

std::vector<std::pair<std::string, std::string>> model_fields(const model::Config& c) {
  std::vector<std::pair<std::string, std::string>> out;
  const json j = model_json(c);
  for (const IntField& f : kModelInts) out.push_back({f.name, j[f.name].dump()});
  for (const char* name : {"route_scale", "rope_theta", "norm_eps"}) out.push_back({name, j[name].dump()});
  return out;
}

std::string write_manifest(const std::string& dir, const Manifest& m) {
  json j;
  j["format"] = kManifestFormat, j["version"] = kManifestVersion, j["run"] = m.run;
  j["steps_done"] = m.steps_done, j["adam_steps"] = m.adam_steps;
  j["seed"] = m.seed, j["batch"] = m.batch, j["seq"] = m.seq, j["lr"] = m.lr, j["bias_rate"] = m.bias_rate;
  j["data"] = {{"bytes", m.data_bytes}, {"crc32", m.data_crc32}};
  j["model"] = model_json(m.model);
  j["mesh"] = {{"dp", m.dp}, {"pp", m.pp}, {"cp", m.cp}, {"tp", m.tp}, {"ep", m.ep},
               {"zero", m.zero}, {"schedule", m.schedule}, {"sp", m.sp}};
  j["tensors"] = json::object();
  for (const auto& [name, t] : m.tensors)
    j["tensors"][name] = {{"shape", t.shape}, {"dtype", "<f4"}, {"bytes", t.bytes}, {"crc32", t.crc32}};
  const std::string text = j.dump(1) + "\n";
  try {
    write_text_file(dir + "/manifest.json", text);
    write_text_file(dir + "/manifest.crc32", crc_hex(crc_of_text(text)) + "\n");
  } catch (const Error& e) {
    return e.what();
  }
  for (const char* name : {"/manifest.json", "/manifest.crc32"}) {
    const std::string path = dir + name;
    const int fd = ::open(path.c_str(), O_RDONLY);
    if (fd < 0) return sys_error("cannot open", path);
    const bool ok = ::fsync(fd) == 0;
    ::close(fd);
    if (!ok) return sys_error("cannot flush", path);
  }
  return "";
}

std::string read_manifest_run(const std::string& dir, std::string* run) {
  const std::string path = dir + "/manifest.json";
  std::string text;
  std::string err = slurp(path, &text, kMaxManifestBytes);
  if (!err.empty()) return err;
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("run") || !j["run"].is_string() || !is_run_id(j["run"].get<std::string>()))
    return path + ": no readable run lineage (field run)";
  *run = j["run"].get<std::string>();
  return "";
}

std::string read_manifest(const std::string& dir, Manifest* out) {
  const std::string path = dir + "/manifest.json";
  std::string text;
  std::string err = slurp(path, &text, kMaxManifestBytes);
  if (!err.empty()) return err;
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) {
    return path + ": not JSON (" + std::string(e.what()) + ")";
  }
  const Reader r(path);
  Manifest m;
  try {
    if (!j.is_object()) throw Bad{path + ": not a JSON object"};
    // what it is
    const json& format = r.at(j, "format", "format");
    if (format != kManifestFormat)
      r.fail("format", "not a lesson 08 checkpoint (\"" + std::string(kManifestFormat) + "\" expected, found " +
                           Reader::shown(format) + ")");
    const json& version = r.at(j, "version", "version");
    if (version != kManifestVersion)
      r.fail("version", "format version " + Reader::shown(version) + ", this build reads version " +
                            std::to_string(kManifestVersion));
    r.only(j, std::set<std::string>(std::begin(kFields), std::end(kFields)), "");
    // the run
    m.run = r.string(j, "run", "run");
    if (!is_run_id(m.run)) r.fail("run", "expected 16 lowercase hex digits, found " + Reader::shown(j["run"]));
    m.steps_done = r.integer(j, "steps_done", "steps_done", 1, 1000000);
    m.adam_steps = r.integer(j, "adam_steps", "adam_steps", 0, 1000000);
    m.seed = r.integer(j, "seed", "seed", 0, INT64_MAX);
    m.batch = r.integer(j, "batch", "batch", 1, 4096);
    m.seq = r.integer(j, "seq", "seq", 2, 1024);
    m.lr = r.number(j, "lr", "lr", 0.0, 1.0);
    m.bias_rate = r.number(j, "bias_rate", "bias_rate", 0.0, 1.0);
    const json& data = r.object(j, "data", "data");
    m.data_bytes = (uint64_t)r.integer(data, "bytes", "data.bytes", 2, INT64_MAX);
    m.data_crc32 = r.crc(data, "crc32", "data.crc32");
    r.only(data, {"bytes", "crc32"}, "data.");
    m.model = model_from(r, r.object(j, "model", "model"));
    const json& mesh = r.object(j, "mesh", "mesh");
    m.dp = r.integer(mesh, "dp", "mesh.dp", 1, 4096), m.pp = r.integer(mesh, "pp", "mesh.pp", 1, 64);
    m.cp = r.integer(mesh, "cp", "mesh.cp", 1, 64), m.tp = r.integer(mesh, "tp", "mesh.tp", 1, 64);
    m.ep = r.integer(mesh, "ep", "mesh.ep", 1, 256), m.zero = r.integer(mesh, "zero", "mesh.zero", 0, 3);
    m.schedule = r.string(mesh, "schedule", "mesh.schedule");
    if (m.schedule != "1f1b" && m.schedule != "zb-h1" && m.schedule != "dualpipe" && m.schedule != "dualpipev")
      r.fail("mesh.schedule", "expected 1f1b, zb-h1, dualpipe or dualpipev, found " + Reader::shown(mesh["schedule"]));
    m.sp = r.boolean(mesh, "sp", "mesh.sp");
    r.only(mesh, {"dp", "pp", "cp", "tp", "ep", "zero", "schedule", "sp"}, "mesh.");
    const json& tensors = r.object(j, "tensors", "tensors");
    uint64_t listed = 0;
    for (auto it = tensors.begin(); it != tensors.end(); ++it) {
      const std::string field = "tensors." + it.key();
      if (!it.value().is_object()) r.fail(field, "expected an object, found " + Reader::shown(it.value()));
      const json& t = it.value();
      TensorEntry e;
      const json& shape = r.at(t, "shape", field + ".shape");
      if (!shape.is_array() || shape.size() > 8) r.fail(field + ".shape", "expected a list of at most 8 sizes, found " + Reader::shown(shape));
      for (size_t d = 0; d < shape.size(); d++)
        e.shape.push_back(r.integer(shape[d], field + ".shape[" + std::to_string(d) + "]", 0, 1 << 30));
      if (r.string(t, "dtype", field + ".dtype") != "<f4") r.fail(field + ".dtype", "expected \"<f4\", found " + Reader::shown(t["dtype"]));
      e.bytes = (uint64_t)r.integer(t, "bytes", field + ".bytes", 0, INT64_MAX);
      e.crc32 = r.crc(t, "crc32", field + ".crc32");
      r.only(t, {"shape", "dtype", "bytes", "crc32"}, field + ".");
      // the file is there, of the size the manifest says
      const std::string file = dir + "/" + it.key() + ".npy";
      struct stat st;
      if (it.key().find('/') != std::string::npos || ::stat(file.c_str(), &st) != 0 || !S_ISREG(st.st_mode))
        r.fail(field, "no file " + file);
      if ((uint64_t)st.st_size != e.bytes)
        r.fail(field + ".bytes", std::to_string(e.bytes) + ", but " + file + " has " + std::to_string(st.st_size) + " bytes");
      listed += e.bytes;
      m.tensors[it.key()] = e;
    }
    // consistency: the directory, the optimizer, the model and its files
    const int64_t dir_step = step_of_dir(dir);
    if (dir_step >= 0 && dir_step != m.steps_done)
      r.fail("steps_done", std::to_string(m.steps_done) + ", but the directory is step " + std::to_string(dir_step));
    if (m.adam_steps != m.steps_done)
      r.fail("adam_steps", std::to_string(m.adam_steps) + ", but steps_done is " + std::to_string(m.steps_done) +
                               " (one AdamW step per training step: m and v are those of step " +
                               std::to_string(m.steps_done) + ")");
    try {
      m.model.validate();
    } catch (const Error& e) {
      r.fail("model", e.what());
    }
    // the files hold the weights, m and v: the model's weights cannot need more than a third of
    // them (checked before the model's shapes are made, so a manifest cannot ask for more memory
    // than its files take on disk)
    const double weights = (double)estimate::param_count(estimate::tiny(m.model, 1));
    if (3.0 * 4.0 * weights > (double)listed + 1e6)
      r.fail("tensors", "the files hold " + std::to_string(listed) + " bytes, the model's weights with AdamW's m and v need " +
                            std::to_string((uint64_t)(12 * weights)));
    const std::map<std::string, Shape> want = checkpoint_files(m.model);
    for (const auto& [name, shape] : want) {
      auto it = m.tensors.find(name);
      if (it == m.tensors.end()) r.fail("tensors." + name, "missing (the model has this tensor)");
      if (it->second.shape != shape)
        r.fail("tensors." + name + ".shape", Reader::shown(json(it->second.shape)) + ", the model's is " + Reader::shown(json(shape)));
    }
    for (const auto& [name, entry] : m.tensors)
      if (!want.count(name)) r.fail("tensors." + name, "not a tensor of the model");
  } catch (const Bad& b) {
    return b.what;
  } catch (const std::exception& e) {  // (none expected: every access above is checked first)
    return path + ": " + e.what();
  }
  // the manifest's own CRC-32, last: a field edited by hand (or a disk's bit flip) is refused
  const std::string crc_path = dir + "/manifest.crc32";
  std::string crc_text;
  err = slurp(crc_path, &crc_text, 64);
  if (!err.empty()) return err;
  while (!crc_text.empty() && (crc_text.back() == '\n' || crc_text.back() == ' ')) crc_text.pop_back();
  const std::string have = crc_hex(crc_of_text(text));
  if (crc_text != have)
    return path + ": its CRC-32 is " + have + ", " + crc_path + " says \"" + crc_text.substr(0, 16) +
           "\": the manifest was edited or damaged";
  *out = std::move(m);
  return "";
}

std::string new_run_id() {
  std::random_device entropy;
  const uint64_t id = ((uint64_t)entropy() << 32) ^ (uint64_t)entropy();
  char buf[24];
  std::snprintf(buf, sizeof buf, "%016llx", (unsigned long long)id);
  return buf;
}

}  // namespace ff::mesh
