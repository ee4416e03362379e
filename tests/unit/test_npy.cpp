// .npy read/write: bit-exact round trips in C++ and through Debian's numpy
// (/usr/bin/python3, installed by `make deps`), and one test per way a file can be bad.
#include <doctest/doctest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "common/core/check.h"
#include "common/core/npy.h"
#include "tests/unit/temp_dir.h"

using namespace ff;

namespace {

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), (std::streamsize)bytes.size());
  REQUIRE_MESSAGE(f.good(), "cannot write " << path);
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// A hand-made .npy file: magic, version, header length (uint16 in version 1, uint32 in 2 and 3),
// the dict padded with spaces to `align` and ended by '\n', then `data`. Each argument can be
// made wrong on purpose.
std::string craft_npy(const std::string& dict, const std::string& data, int major = 1, int minor = 0,
                      size_t align = 64) {
  const size_t prelude = major >= 2 ? 12 : 10;
  std::string header = dict;
  size_t total = prelude + header.size() + 1;
  header += std::string((align - total % align) % align, ' ') + "\n";
  std::string out = "\x93NUMPY";
  out += (char)major;
  out += (char)minor;
  for (size_t i = 0; i < prelude - 8; i++) out += (char)((header.size() >> (8 * i)) & 0xff);
  return out + header + data;
}

std::string dict_for(const std::string& descr, const std::string& shape, const char* fortran = "False") {
  return "{'descr': '" + descr + "', 'fortran_order': " + fortran + ", 'shape': " + shape + ", }";
}

std::string zero_bytes(size_t n) { return std::string(n, '\0'); }

// The ff::Error message load_npy throws for `path`, or "(no error)".
std::string load_error(const std::string& path) {
  try {
    load_npy(path);
  } catch (const ff::Error& e) {
    return e.what();
  }
  return "(no error)";
}

// The error is one line, starts with the path, and mentions `want`.
void check_rejected(const std::string& path, const std::string& want) {
  std::string msg = load_error(path);
  CHECK_MESSAGE(msg.rfind(path + ": ", 0) == 0, "message does not start with the path: " << msg);
  CHECK_MESSAGE(msg.find(want) != std::string::npos, "message lacks '" << want << "': " << msg);
  CHECK_MESSAGE(msg.find('\n') == std::string::npos, "message is not one line: " << msg);
}

bool run_ok(const std::string& cmd) {
  int rc = std::system(cmd.c_str());
  return rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 0;
}

const std::string kPython = "/usr/bin/python3";

// Debian's python with numpy is a hard dependency (make deps installs python3-numpy): a
// missing numpy fails the test rather than skipping it.
void require_numpy() {
  REQUIRE_MESSAGE(run_ok(kPython + " -c 'import numpy' 2>/dev/null"),
                  kPython << " cannot import numpy; install python3-numpy (make deps)");
}

// Runs a Python program (no single quotes in it) with the temp dir as sys.argv[1].
bool run_python(const std::string& program, const std::string& dir) {
  REQUIRE(program.find('\'') == std::string::npos);
  return run_ok(kPython + " -c '" + program + "' " + dir);
}

std::vector<float> special_floats() {
  return {-0.0f, std::ldexp(1.0f, -149) /* smallest subnormal */, INFINITY, -INFINITY,
          std::numeric_limits<float>::max()};
}

// i * 0.25 - 3: exact in float32, and numpy computes the same values.
std::vector<float> quarter_steps(size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; i++) v[i] = (float)i * 0.25f - 3.f;
  return v;
}

}  // namespace

// ---------------------------------------------------------------------------
// round trips within C++

TEST_CASE("npy: float32 round trips bit-exactly for shapes (), (5,), (2, 3, 4), (0, 3)") {
  TempDir dir;
  std::vector<float> specials = special_floats();
  specials[0] = std::nanf("");  // NaN has to survive too (compared as bits)
  struct Case {
    Shape shape;
    std::vector<float> values;
  } cases[] = {{{}, {-1.75f}},
               {{5}, specials},
               {{2, 3, 4}, quarter_steps(24)},
               {{0, 3}, {}}};
  for (const Case& c : cases) {
    CAPTURE(shape_str(c.shape));
    Tensor t = Tensor::from_vector(c.values, c.shape);
    std::string p = dir / "t.npy";
    save_npy(p, t);
    Tensor u = load_npy(p);
    CHECK(u.dtype() == DType::f32);
    CHECK(u.shape() == c.shape);
    CHECK(bitwise_equal(u, t));
    std::string bytes = read_file(p);
    CHECK(bytes.size() == 128 + c.values.size() * 4);  // numpy's header: 128 bytes here
  }
}

TEST_CASE("npy: int64 index tensors round trip as <i8; int32 via write_npy widens on load") {
  TempDir dir;
  std::vector<int64_t> v = {INT64_MIN, -1, 0, 1, INT64_MAX, int64_t(1) << 40};
  Tensor t = Tensor::from_indices(v, {2, 3});
  save_npy(dir / "i64.npy", t);
  NpyArray raw = read_npy(dir / "i64.npy");
  CHECK(raw.descr == "<i8");
  Tensor u = load_npy(dir / "i64.npy");
  CHECK(u.dtype() == DType::i64);
  CHECK(u.shape() == Shape{2, 3});
  CHECK(u.to_index_vector() == v);

  std::vector<int32_t> v32 = {INT32_MIN, -7, 0, INT32_MAX};
  std::vector<char> bytes(v32.size() * 4);
  std::memcpy(bytes.data(), v32.data(), bytes.size());
  write_npy(dir / "i32.npy", "<i4", {4}, bytes);
  NpyArray raw32 = read_npy(dir / "i32.npy");
  CHECK(raw32.descr == "<i4");
  CHECK(raw32.shape == std::vector<int64_t>{4});
  CHECK(raw32.data == bytes);
  Tensor w = load_npy(dir / "i32.npy");
  CHECK(w.dtype() == DType::i64);
  CHECK(w.to_index_vector() == std::vector<int64_t>{INT32_MIN, -7, 0, INT32_MAX});
}

TEST_CASE("npy: the header is numpy's: dict text, spaces to a multiple of 64, then a newline") {
  TempDir dir;
  save_npy(dir / "a.npy", Tensor::zeros({2, 3}));
  std::string b = read_file(dir / "a.npy");
  REQUIRE(b.size() >= 10);
  CHECK(b.compare(0, 8, std::string("\x93NUMPY\x01\x00", 8)) == 0);
  size_t hlen = (unsigned char)b[8] | ((size_t)(unsigned char)b[9] << 8);
  CHECK((10 + hlen) % 64 == 0);
  CHECK(b[10 + hlen - 1] == '\n');
  std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  CHECK(b.compare(10, dict.size(), dict) == 0);
  CHECK(b.size() == 10 + hlen + 24);

  // A header padded to 16 bytes (older writers) reads as well.
  write_file(dir / "align16.npy", craft_npy(dict_for("<f4", "(2,)"), std::string(8, '\0'), 1, 0, 16));
  CHECK(load_npy(dir / "align16.npy").shape() == Shape{2});
}

TEST_CASE("npy: the data start where the file's own header ends: versions 1.0, 2.0, 3.0, headers of 128 and 192 bytes") {
  TempDir dir;
  const std::vector<float> v = {1.5f, -2.f, 3.25f};
  std::string data(12, '\0');
  std::memcpy(&data[0], v.data(), 12);
  for (int major : {1, 2, 3})
    for (size_t align : {64, 128, 192}) {
      const std::string name = "v" + std::to_string(major) + "_" + std::to_string(align) + ".npy";
      const std::string bytes = craft_npy(dict_for("<f4", "(3,)"), data, major, 0, align);
      write_file(dir / name, bytes);
      const NpyInfo info = read_npy_info(dir / name);
      CAPTURE(name);
      CHECK(info.data_offset == bytes.size() - 12);
      CHECK(info.data_offset % align == 0);
      CHECK(load_npy(dir / name).to_vector() == v);
    }
  // a planted reader that ignored the header's length (the writer's 64 bytes) would read header
  // spaces as numbers: the check above is what catches it
  CHECK(npy_header("<f4", {3}).size() != read_npy_info(dir / "v1_192.npy").data_offset);
}

// ---------------------------------------------------------------------------
// round trips through numpy

TEST_CASE("npy: numpy reads what C++ writes (same bytes as np.save), and C++ reads it back") {
  require_numpy();
  TempDir dir;
  save_npy(dir / "f32_3d.npy", Tensor::from_vector(quarter_steps(24), {2, 3, 4}));
  save_npy(dir / "f32_1d.npy", Tensor::from_vector(special_floats(), {5}));
  save_npy(dir / "f32_0d.npy", Tensor::from_vector({1.5f}, {}));
  std::vector<int64_t> ints = {-(int64_t(1) << 62), -1, 0, 1, (int64_t(1) << 62) - 1, int64_t(1) << 40};
  save_npy(dir / "i64.npy", Tensor::from_indices(ints, {3, 2}));

  // numpy checks dtype, shape, values and the exact bytes, then saves 2 * each array.
  const char* program = R"PY(
import io, sys
import numpy as np
d = sys.argv[1]
np.seterr(over="ignore")  # FLT_MAX * 2 is inf on purpose
def check(name, want):
    got = np.load(d + "/" + name + ".npy")
    assert got.dtype == want.dtype, (name, got.dtype)
    assert got.shape == want.shape, (name, got.shape)
    assert np.array_equal(got, want), (name, got, want)
    assert np.array_equal(np.signbit(got), np.signbit(want)), name
    buf = io.BytesIO()
    np.save(buf, want)
    assert open(d + "/" + name + ".npy", "rb").read() == buf.getvalue(), name + ": bytes differ from np.save"
    np.save(d + "/" + name + "_x2.npy", got * got.dtype.type(2))
f32 = np.float32
check("f32_3d", np.arange(24, dtype=f32).reshape(2, 3, 4) * f32(0.25) - f32(3))
check("f32_1d", np.array([-0.0, 2.0**-149, np.inf, -np.inf, np.finfo(f32).max], dtype=f32))
check("f32_0d", np.array(1.5, dtype=f32))
check("i64", np.array([-(1 << 62), -1, 0, 1, (1 << 62) - 1, 1 << 40], dtype=np.int64).reshape(3, 2))
)PY";
  REQUIRE_MESSAGE(run_python(program, dir.path), "the numpy side failed (see its message above)");

  auto twice = [](std::vector<float> v) {
    for (float& x : v) x *= 2.f;
    return v;
  };
  CHECK(bitwise_equal(load_npy(dir / "f32_3d_x2.npy"), Tensor::from_vector(twice(quarter_steps(24)), {2, 3, 4})));
  CHECK(bitwise_equal(load_npy(dir / "f32_1d_x2.npy"), Tensor::from_vector(twice(special_floats()), {5})));
  CHECK(bitwise_equal(load_npy(dir / "f32_0d_x2.npy"), Tensor::from_vector({3.f}, {})));
  std::vector<int64_t> ints2 = ints;
  for (int64_t& x : ints2) x *= 2;
  CHECK(bitwise_equal(load_npy(dir / "i64_x2.npy"), Tensor::from_indices(ints2, {3, 2})));
}

TEST_CASE("npy: C++ reads int32, int64 and float32 arrays numpy writes, and refuses the rest") {
  require_numpy();
  TempDir dir;
  const char* program = R"PY(
import sys
import numpy as np
d = sys.argv[1]
np.save(d + "/i32.npy", np.array([[-2**31, -1, 0], [1, 7, 2**31 - 1]], dtype=np.int32))
np.save(d + "/i64.npy", np.array([-2**63, 2**63 - 1, 42], dtype=np.int64))
np.save(d + "/f32.npy", ((np.arange(12) - 5.5) / 8).astype(np.float32).reshape(3, 4))
np.save(d + "/f32_0d.npy", np.array(-2.5, dtype=np.float32))
np.save(d + "/f32_empty.npy", np.zeros((0, 4), dtype=np.float32))
np.save(d + "/f64.npy", np.zeros(3))
np.save(d + "/big_endian.npy", np.zeros(3, dtype=">f4"))
np.save(d + "/bool.npy", np.zeros(3, dtype=bool))
np.save(d + "/fortran.npy", np.asfortranarray(np.zeros((2, 3), dtype=np.float32)))
# versions 2.0 and 3.0 (a 4-byte header length), as numpy writes them when asked
for v in (2, 3):
    with open(d + "/f32_v%d.npy" % v, "wb") as f:
        np.lib.format.write_array(f, ((np.arange(12) - 5.5) / 8).astype(np.float32).reshape(3, 4), version=(v, 0))
# a header padded further than np.save pads it (the dict numpy writes, 192 bytes in all), read back by numpy
a = np.arange(6, dtype=np.float32).reshape(2, 3)
d_ = np.lib.format.header_data_from_array_1_0(a)
text = repr({k: d_[k] for k in sorted(d_)}).encode()
text += b" " * (192 - 10 - len(text) - 1) + b"\n"
with open(d + "/f32_192.npy", "wb") as f:
    f.write(b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + a.tobytes())
assert np.array_equal(np.load(d + "/f32_192.npy"), a)
)PY";
  REQUIRE_MESSAGE(run_python(program, dir.path), "the numpy side failed (see its message above)");

  Tensor i32 = load_npy(dir / "i32.npy");
  CHECK(i32.dtype() == DType::i64);
  CHECK(i32.shape() == Shape{2, 3});
  CHECK(i32.to_index_vector() == std::vector<int64_t>{INT32_MIN, -1, 0, 1, 7, INT32_MAX});
  CHECK(read_npy(dir / "i32.npy").descr == "<i4");

  Tensor i64 = load_npy(dir / "i64.npy");
  CHECK(i64.shape() == Shape{3});
  CHECK(i64.to_index_vector() == std::vector<int64_t>{INT64_MIN, INT64_MAX, 42});

  std::vector<float> want(12);
  for (int i = 0; i < 12; i++) want[(size_t)i] = ((float)i - 5.5f) / 8.f;  // exact in float32
  CHECK(bitwise_equal(load_npy(dir / "f32.npy"), Tensor::from_vector(want, {3, 4})));
  CHECK(bitwise_equal(load_npy(dir / "f32_0d.npy"), Tensor::from_vector({-2.5f}, {})));
  CHECK(load_npy(dir / "f32_empty.npy").shape() == Shape{0, 4});
  CHECK(bitwise_equal(load_npy(dir / "f32_v2.npy"), Tensor::from_vector(want, {3, 4})));
  CHECK(bitwise_equal(load_npy(dir / "f32_v3.npy"), Tensor::from_vector(want, {3, 4})));
  CHECK(read_npy_info(dir / "f32_192.npy").data_offset == 192);
  CHECK(load_npy(dir / "f32_192.npy").to_vector() == std::vector<float>{0, 1, 2, 3, 4, 5});

  check_rejected(dir / "f64.npy", "unsupported dtype '<f8' (supported: '<f4' float32, '<i4' int32, '<i8' int64)");
  check_rejected(dir / "big_endian.npy", "unsupported dtype '>f4'");
  check_rejected(dir / "bool.npy", "unsupported dtype '|b1'");
  check_rejected(dir / "fortran.npy", "fortran_order True");
}

// ---------------------------------------------------------------------------
// bad files: each is refused with one line naming the file and the problem

TEST_CASE("npy: missing file, wrong magic, unsupported version, truncated header") {
  TempDir dir;
  check_rejected(dir / "missing.npy", "No such file or directory");
  check_rejected(dir.path, "is a directory");

  write_file(dir / "zip.npy", "PK\x03\x04 this is an .npz (a zip), not an .npy");
  check_rejected(dir / "zip.npy", "not a .npy file");
  write_file(dir / "empty.npy", "");
  check_rejected(dir / "empty.npy", "not a .npy file");

  std::string good_dict = dict_for("<f4", "(2,)");
  write_file(dir / "v4.npy", craft_npy(good_dict, zero_bytes(8), 4, 0));
  check_rejected(dir / "v4.npy", "unsupported .npy format version 4.0 (supported: 1.0, 2.0, 3.0)");
  write_file(dir / "v1_1.npy", craft_npy(good_dict, zero_bytes(8), 1, 1));
  check_rejected(dir / "v1_1.npy", "version 1.1");
  write_file(dir / "v2_cut.npy", craft_npy(good_dict, zero_bytes(8), 2, 0).substr(0, 11));
  check_rejected(dir / "v2_cut.npy", "truncated header");

  std::string whole = craft_npy(good_dict, zero_bytes(8));
  write_file(dir / "prelude_cut.npy", whole.substr(0, 8));
  check_rejected(dir / "prelude_cut.npy", "truncated header");
  write_file(dir / "header_cut.npy", whole.substr(0, 40));
  check_rejected(dir / "header_cut.npy", "truncated header");
}

TEST_CASE("npy: truncated data and trailing garbage") {
  TempDir dir;
  std::string dict = dict_for("<f4", "(2, 3)");
  write_file(dir / "short.npy", craft_npy(dict, zero_bytes(20)));
  check_rejected(dir / "short.npy", "truncated data: shape (2, 3) of <f4 needs 24 bytes, the file has 20");
  write_file(dir / "long.npy", craft_npy(dict, zero_bytes(24) + "junk"));
  check_rejected(dir / "long.npy", "trailing garbage: 4 bytes");
  write_file(dir / "no_data.npy", craft_npy(dict_for("<i8", "()"), ""));
  check_rejected(dir / "no_data.npy", "truncated data");
}

TEST_CASE("npy: unsupported dtypes and fortran order") {
  TempDir dir;
  for (const char* descr : {"<f8", ">f4", "|b1", "<f2", "<u4", "|i1", "f4", "<U5"}) {
    INFO("descr " << std::string(descr));
    write_file(dir / "d.npy", craft_npy(dict_for(descr, "(2,)"), zero_bytes(8)));
    check_rejected(dir / "d.npy", std::string("unsupported dtype '") + descr + "' (supported: ");
  }
  write_file(dir / "struct.npy",
             craft_npy("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,), }", zero_bytes(8)));
  check_rejected(dir / "struct.npy", "unsupported dtype: a structured dtype");
  write_file(dir / "fortran.npy", craft_npy(dict_for("<f4", "(2, 3)", "True"), zero_bytes(24)));
  check_rejected(dir / "fortran.npy", "fortran_order True");
}

TEST_CASE("npy: malformed header dicts") {
  TempDir dir;
  const char* dicts[] = {
      "",                                                                   // nothing
      "not a dict",                                                         // no brace
      "{'descr': '<f4', 'fortran_order': False, 'shape': (2,)",             // no closing brace
      "{'descr': '<f4', 'shape': (2,), }",                                  // missing key
      "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x': 1, }",  // unknown key
      "{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2,), }",  // twice
      "{'descr': '<f4', 'fortran_order': Nope, 'shape': (2,), }",           // not a bool
      "{'descr': '<f4', 'fortran_order': False, 'shape': (2), }",           // an int, not a tuple
      "{'descr': '<f4', 'fortran_order': False, 'shape': [2], }",           // a list
      "{'descr': '<f4', 'fortran_order': False, 'shape': (2 3), }",         // no comma
      "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), } junk",     // text after
      "{'descr': <f4, 'fortran_order': False, 'shape': (2,), }",            // unquoted
      "{'descr: '<f4', 'fortran_order': False, 'shape': (2,), }",           // quotes off
      "{'descr': '<f4' 'fortran_order': False, 'shape': (2,), }",           // missing comma
  };
  for (const char* d : dicts) {
    INFO("dict " << std::string(d));
    write_file(dir / "m.npy", craft_npy(d, zero_bytes(8)));
    check_rejected(dir / "m.npy", "malformed header dict");
  }
  // The writers' variations are fine: double quotes, any key order, no trailing comma.
  write_file(dir / "ok.npy", craft_npy("{\"shape\": (2,), \"fortran_order\": False, \"descr\": \"<f4\"}",
                                       zero_bytes(8)));
  CHECK(load_npy(dir / "ok.npy").shape() == Shape{2});
}

TEST_CASE("npy: absurd shapes are refused before anything is allocated") {
  TempDir dir;
  struct Case {
    const char* shape;
    const char* want;
  } cases[] = {
      {"(-1, 3)", "absurd shape: negative dimension"},
      {"(1, 1, 1, 1, 1, 1, 1, 1, 1)", "absurd shape: more than 8 dimensions"},
      {"(99999999999999999999,)", "absurd shape: a dimension does not fit in 64 bits"},
      {"(4294967296, 4294967296)", "absurd shape (4294967296, 4294967296): its size in bytes overflows"},
      // 4 EiB: fits in 64 bits, so only the file size can refuse it (an attempt to
      // allocate would throw std::bad_alloc, not ff::Error, and fail this test)
      {"(1073741824, 1073741824)", "truncated data: shape (1073741824, 1073741824) of <f4 needs 4611686018427387904 bytes"},
  };
  for (const Case& c : cases) {
    INFO("shape " << std::string(c.shape));
    write_file(dir / "s.npy", craft_npy(dict_for("<f4", c.shape), zero_bytes(8)));
    check_rejected(dir / "s.npy", c.want);
  }
  // 8 dimensions is the limit, and is fine.
  write_file(dir / "s8.npy", craft_npy(dict_for("<f4", "(1, 1, 1, 1, 1, 1, 1, 2)"), zero_bytes(8)));
  CHECK(load_npy(dir / "s8.npy").numel() == 2);
}

TEST_CASE("npy: writing to a missing directory, a directory or a full disk fails with the reason") {
  TempDir dir;
  std::string p = dir / "no_such_dir/a.npy";
  std::string msg;
  try {
    save_npy(p, Tensor::zeros({2}));
  } catch (const ff::Error& e) {
    msg = e.what();
  }
  CHECK_MESSAGE(msg == "cannot write " + p + ": No such file or directory", msg);
  msg.clear();
  try {
    save_npy(dir.path, Tensor::zeros({2}));
  } catch (const ff::Error& e) {
    msg = e.what();
  }
  CHECK_MESSAGE(msg.find("it is a directory") != std::string::npos, msg);
  if (std::filesystem::exists("/dev/full")) {  // every write to it fails with ENOSPC
    msg.clear();
    try {
      save_npy("/dev/full", Tensor::zeros({2}));
    } catch (const ff::Error& e) {
      msg = e.what();
    }
    CHECK_MESSAGE(msg == "cannot write /dev/full: No space left on device", msg);
  }
  CHECK_THROWS_AS(write_npy(dir / "x.npy", "<f4", {3}, std::vector<char>(8)), ff::Error);  // 12 needed
  CHECK_THROWS_AS(write_npy(dir / "x.npy", "<f8", {1}, std::vector<char>(8)), ff::Error);
}
