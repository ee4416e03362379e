// tests/unit/temp_dir.h — a fresh directory under /tmp for one test, removed with everything in it
// when the test ends.
#pragma once
#include <doctest/doctest.h>
#include <stdlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>

struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/fivefold-test-XXXXXX";
    char* p = ::mkdtemp(tmpl);
    REQUIRE_MESSAGE(p != nullptr, "mkdtemp failed: " << std::string(std::strerror(errno)));
    path = p;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string operator/(const std::string& name) const { return path + "/" + name; }
};
