// Lesson 08's checkpoint manifest read as data (lessons/08_mesh/manifest.h): every field fuzzed by
// type and value must be refused with one line naming the field, the consistency checks must
// catch a manifest that disagrees with its directory, its files or its model, and an edit that
// keeps the schema must be caught by the manifest's own CRC-32.
#include <doctest/doctest.h>
#include <sys/stat.h>
#include <zlib.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/core/npy.h"
#include "lessons/08_mesh/manifest.h"
#include "tests/unit/temp_dir.h"

using namespace ff;
using namespace ff::mesh;
using json = nlohmann::json;

namespace {

model::Config tiny() {
  model::Config c;
  c.vocab = 10, c.dim = 8, c.layers = 2, c.dense_layers = 1, c.heads = 2, c.d_nope = 4, c.d_rope = 2, c.d_v = 4;
  c.q_lora = 4, c.kv_lora = 4, c.ffn = 8, c.experts = 4, c.topk = 2, c.shared = 1, c.moe_ffn = 4;
  return c;
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
  REQUIRE(f.good());
}

// manifest.json replaced by j, with manifest.crc32 made to match: only the schema can refuse it.
void write_signed(const std::string& dir, const json& j) {
  const std::string text = j.dump(1) + "\n";
  write_text(dir + "/manifest.json", text);
  char crc[16];
  std::snprintf(crc, sizeof crc, "%08x\n",
                (unsigned)crc32(crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(text.data()), (uInt)text.size()));
  write_text(dir + "/manifest.crc32", crc);
}

// A complete checkpoint of the tiny model after `steps` steps under root/step-NNNNNN (zeros).
std::string make_checkpoint(const std::string& root, int64_t steps) {
  char name[32];
  std::snprintf(name, sizeof name, "/step-%06lld", (long long)steps);
  const std::string dir = root + name;
  REQUIRE(::mkdir(dir.c_str(), 0755) == 0);
  Manifest m;
  m.run = "0123456789abcdef", m.steps_done = steps, m.adam_steps = steps;
  m.seed = 7, m.batch = 4, m.seq = 16, m.lr = 3e-3, m.bias_rate = 1e-3, m.data_bytes = 1000, m.data_crc32 = 12345;
  m.model = tiny();
  for (const auto& [file, shape] : checkpoint_files(m.model)) {
    const std::string path = dir + "/" + file + ".npy";
    save_npy(path, Tensor::zeros(shape));
    struct stat st;
    REQUIRE(::stat(path.c_str(), &st) == 0);
    m.tensors[file] = {shape, (uint64_t)st.st_size, 0};
  }
  REQUIRE(write_manifest(dir, m) == "");
  return dir;
}

// Every leaf of j (numbers, strings, booleans, null) with its field name as the messages write it.
void leaves(const json& j, const std::string& name, std::vector<std::pair<json::json_pointer, std::string>>* out,
            const json::json_pointer& at) {
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it)
      leaves(it.value(), name.empty() ? it.key() : name + "." + it.key(), out, at / it.key());
  } else if (j.is_array()) {
    for (size_t i = 0; i < j.size(); i++) leaves(j[i], name + "[" + std::to_string(i) + "]", out, at / i);
  } else {
    out->push_back({at, name});
  }
}

}  // namespace

TEST_CASE("manifest: what write_manifest writes, read_manifest reads back field for field") {
  TempDir t;
  const std::string dir = make_checkpoint(t.path, 5);
  Manifest m;
  REQUIRE(read_manifest(dir, &m) == "");
  CHECK(m.run == "0123456789abcdef");
  CHECK(m.steps_done == 5);
  CHECK(m.adam_steps == 5);
  CHECK(m.seed == 7);
  CHECK(m.batch == 4);
  CHECK(m.seq == 16);
  CHECK(m.lr == 3e-3);
  CHECK(m.data_crc32 == 12345);
  CHECK(model_fields(m.model) == model_fields(tiny()));
  CHECK(m.tensors.size() == checkpoint_files(tiny()).size());
  std::string run;
  CHECK(read_manifest_run(dir, &run) == "");
  CHECK(run == "0123456789abcdef");
  // the same, signed again by the test's own CRC-32: the test's signature is the writer's
  write_signed(dir, json::parse(read_text(dir + "/manifest.json")));
  CHECK(read_manifest(dir, &m) == "");
}

TEST_CASE("manifest: every field fuzzed (a string for a number, null, negative, huge, a list, missing) is refused naming it") {
  TempDir t;
  const std::string dir = make_checkpoint(t.path, 5);
  const json good = json::parse(read_text(dir + "/manifest.json"));
  std::vector<std::pair<json::json_pointer, std::string>> all, fields;
  leaves(good, "", &all, json::json_pointer());
  // every field but the tensors', and every field of three tensors (first, middle, last)
  const std::vector<std::string> sampled = {"tensors.embed.", "tensors.layers.1.moe.experts_w1.", "tensors.norm.exp_avg_sq."};
  for (const auto& f : all) {
    bool keep = f.second.rfind("tensors.", 0) != 0;
    for (const std::string& s : sampled) keep = keep || f.second.rfind(s, 0) == 0;
    if (keep) fields.push_back(f);
  }
  REQUIRE(fields.size() > 40);
  const std::vector<std::pair<const char*, std::function<void(json&, const json::json_pointer&)>>> mutations = {
      {"a string", [](json& j, const json::json_pointer& p) { j[p] = "x"; }},
      {"null", [](json& j, const json::json_pointer& p) { j[p] = nullptr; }},
      {"negative", [](json& j, const json::json_pointer& p) { j[p] = -1; }},
      {"huge", [](json& j, const json::json_pointer& p) { j[p] = 1e300; }},
      {"2^64 - 1", [](json& j, const json::json_pointer& p) { j[p] = UINT64_MAX; }},
      {"a list", [](json& j, const json::json_pointer& p) { j[p] = json::array({1, 2}); }},
      {"missing", [](json& j, const json::json_pointer& p) {
         json& parent = j[p.parent_pointer()];
         if (parent.is_array()) parent.erase((size_t)std::stoul(p.back()));
         else parent.erase(p.back());
       }}};
  int refused = 0;
  for (const auto& [pointer, name] : fields)
    for (const auto& [what, mutate] : mutations) {
      json bad = good;
      mutate(bad, pointer);
      write_signed(dir, bad);
      Manifest m;
      const std::string err = read_manifest(dir, &m);
      CAPTURE(name);
      CAPTURE(what);
      CAPTURE(err);
      // a shape's size removed shortens the shape: the shape is named
      const std::string named = std::string(what) == "missing" && name.back() == ']' ? name.substr(0, name.rfind('[')) : name;
      CHECK(err.find("field " + named) != std::string::npos);
      CHECK(err.rfind(dir + "/manifest.json: ", 0) == 0);
      CHECK(err.find('\n') == std::string::npos);
      refused += !err.empty();
    }
  CHECK(refused == (int)(fields.size() * mutations.size()));
  // and a whole tensor's entry removed, for every tensor
  for (auto it = good["tensors"].begin(); it != good["tensors"].end(); ++it) {
    json bad = good;
    bad["tensors"].erase(it.key());
    write_signed(dir, bad);
    Manifest m;
    const std::string err = read_manifest(dir, &m);
    CAPTURE(it.key());
    CHECK(err.find("field tensors." + it.key() + ": missing") != std::string::npos);
  }
}

TEST_CASE("manifest: consistency with the directory, the optimizer, the files and the model") {
  TempDir t;
  const std::string dir = make_checkpoint(t.path, 5);
  const json good = json::parse(read_text(dir + "/manifest.json"));
  const auto refused = [&](const std::function<void(json&)>& edit, const std::string& want) {
    json bad = good;
    edit(bad);
    write_signed(dir, bad);
    Manifest m;
    const std::string err = read_manifest(dir, &m);
    CAPTURE(want);
    CHECK(err.find(want) != std::string::npos);
  };
  refused([](json& j) { j["steps_done"] = 6, j["adam_steps"] = 6; }, "field steps_done: 6, but the directory is step 5");
  refused([](json& j) { j["adam_steps"] = 0; }, "field adam_steps: 0, but steps_done is 5");
  refused([](json& j) { j["adam_steps"] = 4; }, "field adam_steps: 4");
  refused([](json& j) { j["tensors"]["embed"]["shape"] = {10, 9}; }, "field tensors.embed.shape: [10,9], the model's is [10,8]");
  refused([](json& j) { j["tensors"]["embed"]["bytes"] = j["tensors"]["embed"]["bytes"].get<int64_t>() + 4; }, "field tensors.embed.bytes");
  refused([](json& j) { j["tensors"]["extra"] = j["tensors"]["embed"]; }, "field tensors.extra: no file");
  refused([](json& j) { j["model"]["topk"] = 5; }, "field model: model: topk = 5 must be in [1, experts = 4]");
  refused([](json& j) { j["model"]["dim"] = 16; }, "field tensors");  // the files are the old model's
  refused([](json& j) { j["model"]["size"] = 1; }, "field model.size: not a field of this format");
  refused([](json& j) { j["comment"] = "hi"; }, "field comment: not a field of this format");
  refused([](json& j) { j["format"] = "something else"; }, "field format: not a lesson 08 checkpoint");
  refused([](json& j) { j["version"] = 1; }, "field version: format version 1, this build reads version 2");
  refused([](json& j) { j["run"] = "0123456789ABCDEF"; }, "field run: expected 16 lowercase hex digits");
  refused([](json& j) { j["mesh"]["schedule"] = "gpipe"; }, "field mesh.schedule");
  refused([](json& j) { j["tensors"]["embed"]["dtype"] = "<f8"; }, "field tensors.embed.dtype");
  refused([](json& j) { j["lr"] = 1.5; }, "field lr: expected a number in [0, 1], found 1.5");
  refused([](json& j) { j["batch"] = 4.0; }, "field batch: expected an integer");  // 4.0 is not JSON's integer 4
  // a directory not named step-NNNNNN is read whatever its steps
  write_signed(dir, good);
  const std::string moved = t.path + "/mine";
  REQUIRE(std::rename(dir.c_str(), moved.c_str()) == 0);
  Manifest m;
  CHECK(read_manifest(moved, &m) == "");
}

TEST_CASE("manifest: an edit that keeps the schema is caught by the manifest's CRC-32; a missing CRC file too") {
  TempDir t;
  const std::string dir = make_checkpoint(t.path, 5);
  std::string text = read_text(dir + "/manifest.json");
  const size_t at = text.find("\"seed\": 7");
  REQUIRE(at != std::string::npos);
  text.replace(at, 9, "\"seed\": 8");  // a legal value, the data position of another run
  write_text(dir + "/manifest.json", text);
  Manifest m;
  std::string err = read_manifest(dir, &m);
  CHECK(err.find("the manifest was edited or damaged") != std::string::npos);
  CHECK(err.find(dir + "/manifest.crc32 says") != std::string::npos);
  REQUIRE(std::remove((dir + "/manifest.crc32").c_str()) == 0);
  err = read_manifest(dir, &m);
  CHECK(err.find("cannot read " + dir + "/manifest.crc32") != std::string::npos);
  write_text(dir + "/manifest.json", "{\"format\": ");
  CHECK(read_manifest(dir, &m).find("not JSON") != std::string::npos);
}
