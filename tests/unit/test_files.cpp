// Output files (common/util/files.h): checked writes that appear whole or not at all, and
// the path checks a lesson runs before any work.
#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <fstream>
#include <sstream>
#include <string>

#include "common/core/check.h"
#include "common/util/files.h"
#include "tests/unit/temp_dir.h"

using namespace ff;
namespace fs = std::filesystem;

namespace {

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Files in dir other than the given one: temporaries left behind would show here.
int entries(const std::string& dir) {
  int n = 0;
  for (const auto& e : fs::directory_iterator(dir)) n += e.path().filename().string()[0] == '.';
  return n;
}
}  // namespace

TEST_CASE("files: a committed file holds what was written; an uncommitted one never appears") {
  TempDir d;
  {
    OutputFile f(d / "a.txt");
    f.write("hello ");
    f.printf("%d %s\n", 42, "world");
    CHECK_FALSE(fs::exists(d / "a.txt"));  // not under its final name until complete
    f.commit();
  }
  CHECK(slurp(d / "a.txt") == "hello 42 world\n");
  {
    OutputFile f(d / "a.txt");
    f.write("half");  // destroyed without commit: an error happened before the end
  }
  CHECK(slurp(d / "a.txt") == "hello 42 world\n");
  CHECK(entries(d.path) == 0);
}

TEST_CASE("files: append starts from the current contents and says whether there were any") {
  TempDir d;
  {
    OutputFile f(d / "m.csv", OutputFile::Mode::append);
    CHECK_FALSE(f.had_content());
    f.write("h\n1\n");
    f.commit();
  }
  OutputFile f(d / "m.csv", OutputFile::Mode::append);
  CHECK(f.had_content());
  f.write("2\n");
  f.commit();
  CHECK(slurp(d / "m.csv") == "h\n1\n2\n");
}

TEST_CASE("files: a failed write names the file and the reason, and replaces nothing") {
  TempDir d;
  write_text_file(d / "keep.txt", "old\n");
  CHECK(error_of([&] { write_text_file(d / "no/such/dir/x", "y"); }) ==
        "cannot write " + (d / "no/such/dir/x") + ": No such file or directory");
  CHECK(error_of([&] { write_text_file(d.path, "y"); }) ==
        "cannot write " + d.path + ": it is a directory");
  if (fs::exists("/dev/full")) {  // written in place (never renamed over), and every write fails
    CHECK(error_of([&] { write_text_file("/dev/full", "y"); }) ==
          "cannot write /dev/full: No space left on device");
    CHECK(fs::is_character_file("/dev/full"));
  }
  CHECK(slurp(d / "keep.txt") == "old\n");
  CHECK(entries(d.path) == 0);
}

TEST_CASE("files: output paths are checked before any work, creating missing directories") {
  TempDir d;
  write_text_file(d / "plain", "x");
  CHECK(check_output_path(d / "new/sub/t.json", PathKind::file) == "");
  CHECK(fs::is_directory(d / "new/sub"));
  CHECK_FALSE(fs::exists(d / "new/sub/t.json"));  // checked, not created
  CHECK(check_output_path(d / "dumpdir", PathKind::dir) == "");
  CHECK(fs::is_directory(d / "dumpdir"));
  CHECK(check_output_path(d.path, PathKind::file) == d.path + " is a directory; give a file name");
  CHECK(check_output_path(d / "plain", PathKind::dir) ==
        (d / "plain") + " exists and is not a directory");
  CHECK(check_output_path(d / "plain/x.csv", PathKind::file) ==
        (d / "plain/x.csv") + ": cannot create the directory " + (d / "plain") + ": Not a directory");
  CHECK(check_output_path(d / "plain", PathKind::file) == "");  // an existing file is replaced
  CHECK(check_output_path("/proc/fivefold/x.csv", PathKind::file) != "");
  if (fs::exists("/dev/full")) CHECK(check_output_path("/dev/full", PathKind::file) == "");
  CHECK(entries(d.path) == 0);
}
