// common/util/files.cpp — checked, atomic output files (see files.h).
#include "common/util/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdarg>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <vector>

#include "common/util/error.h"

namespace ff {

namespace fs = std::filesystem;

static std::string parent_of(const std::string& path) {
  fs::path parent = fs::path(path).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

// A new empty file in dir with a unique name, opened for writing; "" and errno on failure.
static std::string make_temporary(const std::string& dir, const std::string& stem, int* fd) {
  std::string name = dir + "/." + stem + ".tmp-XXXXXX";
  std::vector<char> buf(name.begin(), name.end());
  buf.push_back('\0');
  *fd = ::mkstemp(buf.data());
  if (*fd < 0) return "";
  // mkstemp creates 0600; an output file gets the permissions a plain fopen would give it.
  mode_t mask = ::umask(0);
  ::umask(mask);
  ::fchmod(*fd, 0666 & ~mask);
  return std::string(buf.data());
}

OutputFile::OutputFile(std::string path, Mode mode) : path_(std::move(path)) {
  struct stat st;
  const bool exists = ::stat(path_.c_str(), &st) == 0;
  if (exists && S_ISDIR(st.st_mode)) throw Error("cannot write " + path_ + ": it is a directory");
  had_content_ = exists && S_ISREG(st.st_mode) && st.st_size > 0;
  if (exists && !S_ISREG(st.st_mode)) {  // a device, a FIFO: written in place
    f_ = std::fopen(path_.c_str(), mode == Mode::append ? "a" : "w");
    if (!f_) fail(errno);
    return;
  }
  int fd = -1;
  tmp_ = make_temporary(parent_of(path_), fs::path(path_).filename().string(), &fd);
  if (tmp_.empty()) fail(errno);
  f_ = ::fdopen(fd, "w");
  if (!f_) {
    int err = errno;
    ::close(fd);
    fail(err);
  }
  if (mode == Mode::append && had_content_) {  // start from what is there
    std::FILE* in = std::fopen(path_.c_str(), "rb");
    if (!in) fail(errno);
    char buf[1 << 16];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, in)) > 0) write(buf, n);
    bool bad = std::ferror(in);
    std::fclose(in);
    if (bad) throw Error("cannot read " + path_ + " to append to it");
  }
}

OutputFile::~OutputFile() {
  if (f_) std::fclose(f_);
  if (!tmp_.empty()) ::unlink(tmp_.c_str());
}

void OutputFile::fail(int err) {
  if (f_) std::fclose(f_);
  f_ = nullptr;
  if (!tmp_.empty()) ::unlink(tmp_.c_str());
  tmp_.clear();
  throw Error("cannot write " + path_ + ": " + std::strerror(err));
}

void OutputFile::write(const void* data, size_t bytes) {
  FF_CHECK(f_, "OutputFile " << path_ << ": write after commit");
  if (error_ || bytes == 0) return;
  if (std::fwrite(data, 1, bytes, f_) != bytes) error_ = errno ? errno : EIO;
}

void OutputFile::printf(const char* fmt, ...) {
  char small[512];
  va_list ap;
  va_start(ap, fmt);
  int n = std::vsnprintf(small, sizeof small, fmt, ap);
  va_end(ap);
  if (n < 0) return (void)(error_ = error_ ? error_ : EINVAL);
  if ((size_t)n < sizeof small) return write(small, (size_t)n);
  std::vector<char> big((size_t)n + 1);
  va_start(ap, fmt);
  std::vsnprintf(big.data(), big.size(), fmt, ap);
  va_end(ap);
  write(big.data(), (size_t)n);
}

void OutputFile::commit() {
  FF_CHECK(f_, "OutputFile " << path_ << ": committed twice");
  if (error_) fail(error_);
  if (std::fflush(f_) != 0 || std::ferror(f_)) fail(errno ? errno : EIO);
  std::FILE* f = f_;
  f_ = nullptr;
  if (std::fclose(f) != 0) fail(errno);
  if (!tmp_.empty() && std::rename(tmp_.c_str(), path_.c_str()) != 0) fail(errno);
  tmp_.clear();
}

void write_text_file(const std::string& path, const std::string& text) {
  OutputFile f(path);
  f.write(text);
  f.commit();
}

// Creates a file in dir and removes it again: the one honest test that dir takes files
// (permissions, read-only mounts, root's exemptions all included).
static std::string probe_dir(const std::string& dir, const std::string& shown) {
  int fd = -1;
  std::string tmp = make_temporary(dir, "fivefold-probe", &fd);
  if (tmp.empty()) return shown + ": cannot create files in " + dir + ": " + std::strerror(errno);
  ::close(fd);
  ::unlink(tmp.c_str());
  return "";
}

static std::string create_dirs(const std::string& dir, const std::string& shown) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return shown + ": cannot create the directory " + dir + ": " + ec.message();
  return "";
}

std::string check_output_path(const std::string& path, PathKind kind) {
  if (path.empty()) return "";
  struct stat st;
  const bool exists = ::stat(path.c_str(), &st) == 0;
  if (kind == PathKind::dir) {
    if (exists && !S_ISDIR(st.st_mode)) return path + " exists and is not a directory";
    if (!exists) {
      std::string e = create_dirs(path, path);
      if (!e.empty()) return e;
    }
    return probe_dir(path, path);
  }
  if (exists && S_ISDIR(st.st_mode)) return path + " is a directory; give a file name";
  if (exists && !S_ISREG(st.st_mode)) {
    if (S_ISFIFO(st.st_mode)) return "";  // opening it now would wait for a reader
    int fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK);
    if (fd < 0) return path + ": cannot write: " + std::strerror(errno);
    ::close(fd);
    return "";
  }
  const std::string parent = parent_of(path);
  if (!exists) {
    std::string e = create_dirs(parent, path);
    if (!e.empty()) return e;
  }
  return probe_dir(parent, path);  // the file is written next to itself, then renamed
}

// FF_SOURCE_DIR: the tree this file was compiled in (the Makefile defines it for this object).
#ifndef FF_SOURCE_DIR
#define FF_SOURCE_DIR ""
#endif

std::string course_data_file(const std::string& name) {
  const std::string rel = "data/" + name;
  auto readable = [](const fs::path& p) { return ::access(p.c_str(), R_OK) == 0; };
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    for (fs::path dir = exe.parent_path(); !dir.empty(); dir = dir.parent_path()) {
      if (readable(dir / rel)) return (dir / rel).string();
      if (dir == dir.root_path()) break;
    }
  }
  const fs::path source = FF_SOURCE_DIR;
  if (!source.empty() && readable(source / rel)) return (source / rel).string();
  return rel;
}

}  // namespace ff
