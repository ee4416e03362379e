// common/lesson/corpus.h — a character-level text corpus and its training batches.
//
//   CharCorpus corpus;
//   std::string err = CharCorpus::try_load("data/tinyshakespeare.txt", &corpus);
//   L.usage_error_if(!err.empty(), err);    // error: cannot read PATH: No such file ...
//   auto b = corpus.batch(CharCorpus::Split::train, step, B, L, row0, row1, seed);
//
// Design rules:
//  * A token is a byte of the file; the vocabulary is the distinct bytes, sorted, and a
//    token's id is its place there (tinyshakespeare: 65 of them, '\n' first).
//  * train is the first 90% of the file (n * 9 / 10 bytes), validation the rest.
//  * Row r of the global (B, L) batch of step s starts at an offset that is a pure function
//    of (seed, split, s, r), drawn with the core's counter-based generator (ff::randint):
//    any rank builds its rows [row0, row1) alone and gets the same bits as the rows of the
//    whole batch, whatever the world size. Distributed training relies on it.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/core/tensor.h"

namespace ff {

class CharCorpus {
 public:
  enum class Split { train, val };
  struct Batch {
    Tensor inputs;   // int64 (row1 - row0, L) on cpu: ids of the bytes at [o, o + L)
    Tensor targets;  // int64 (row1 - row0, L): the next byte's, [o + 1, o + L + 1)
  };

  // The file at path. A file that cannot be read throws ff::Error "cannot read PATH: reason".
  static CharCorpus load(const std::string& path);
  // The same, as an error message ("" on success) for a lesson's usage_error_if.
  static std::string try_load(const std::string& path, CharCorpus* out);
  // A corpus of the given text (at least 2 bytes, so that both splits are not empty).
  static CharCorpus from_text(const std::string& text);

  int64_t size() const { return (int64_t)text_.size(); }  // bytes of the whole text
  int64_t split_size(Split s) const;                       // bytes of one split
  int64_t vocab_size() const { return (int64_t)vocab_.size(); }
  const std::string& vocab() const { return vocab_; }      // the distinct bytes, sorted
  uint32_t crc32() const;                                  // zlib's CRC-32 of the text (which text)

  // Bytes <-> ids. A byte outside the vocabulary, or an id outside [0, vocab_size), is an
  // ff::Error naming it.
  std::vector<int64_t> encode(const std::string& text) const;
  std::string decode(const std::vector<int64_t>& ids) const;

  // Rows [row0, row1) of the global (B, L) batch of `step` from `split` (see the design
  // rules). Needs 0 <= row0 <= row1 <= B, step >= 0 and L < split_size(split).
  Batch batch(Split split, int64_t step, int64_t B, int64_t L, int64_t row0, int64_t row1,
              uint64_t seed) const;

 private:
  std::string text_;
  std::string vocab_;
  int64_t id_of_[256] = {};  // byte -> id; -1 for a byte not in the text
};

}  // namespace ff
