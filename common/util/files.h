// common/util/files.h — output files that are checked and appear whole or not at all, and
// the course's input files found from any working directory.
//
// Design rules:
//  * Every write is checked (fwrite, fflush, fclose, rename). A failure throws ff::Error
//    "cannot write PATH: <strerror>" naming the file the user gave, never a temporary.
//  * A regular file is written to a temporary name in the same directory and renamed over
//    PATH only when complete, so a reader (numpy, Perfetto, a plot script) never sees a
//    truncated file. An existing PATH that is not a regular file (/dev/full, a FIFO, a
//    terminal) is written in place: renaming over a device would replace it.
//  * Appending copies the current contents into the temporary first: the same guarantee.
//  * check_output_path() is what a program runs before any work, so that a bad path costs
//    nothing: missing parent directories are created, a FILE must not be a directory, a DIR
//    must be one, and the place must really take a file (tried, then removed).
#pragma once
#include <cstddef>
#include <cstdio>
#include <string>

namespace ff {

class OutputFile {
 public:
  enum class Mode { replace, append };
  explicit OutputFile(std::string path, Mode mode = Mode::replace);
  ~OutputFile();  // without commit(): the temporary is removed, PATH is left as it was
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;

  // True when PATH existed with content before (an append then skips its header).
  bool had_content() const { return had_content_; }
  void write(const void* data, size_t bytes);
  void write(const std::string& text) { write(text.data(), text.size()); }
  void printf(const char* fmt, ...) __attribute__((format(printf, 2, 3)));
  // Flushes, closes and renames into place; throws ff::Error on any failure.
  void commit();

 private:
  [[noreturn]] void fail(int err);
  std::string path_, tmp_;  // tmp_ empty: writing PATH in place
  std::FILE* f_ = nullptr;
  bool had_content_ = false;
  int error_ = 0;  // the first failed write's errno, reported at commit
};

// Writes text as PATH (replacing it), checked and atomic as above.
void write_text_file(const std::string& path, const std::string& text);

// "" when PATH can be written as a file (kind "FILE") or used as a directory to write files
// into (kind "DIR"), creating missing parent directories (and DIR itself); otherwise one
// sentence saying what is wrong, starting with PATH.
enum class PathKind { file, dir };
std::string check_output_path(const std::string& path, PathKind kind);

// The course's data file NAME (data/NAME of the repository, e.g. "tinyshakespeare.txt") as a
// path that works from any working directory: data/NAME under the nearest of the running
// executable's directory and its parents that has it (build/bin/08_mesh finds its clone's),
// else under the source tree the program was built from; "data/NAME" when neither has it,
// so that the read that follows names the file it missed.
std::string course_data_file(const std::string& name);

}  // namespace ff
