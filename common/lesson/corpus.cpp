// common/lesson/corpus.cpp — CharCorpus: reading, the vocabulary, and batches.
#include "common/lesson/corpus.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <zlib.h>

#include "common/core/check.h"

namespace ff {

std::string CharCorpus::try_load(const std::string& path, CharCorpus* out) {
  auto fail = [&](int err) { return "cannot read " + path + ": " + std::strerror(err); };
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(path.c_str(), "rb"), std::fclose);
  if (!f) return fail(errno);
  std::string text;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f.get())) > 0) text.append(buf, n);
  if (std::ferror(f.get())) return fail(errno);  // e.g. EISDIR for a directory
  if (text.size() < 2)
    return path + " has " + std::to_string(text.size()) + " bytes: a corpus needs at least 2";
  *out = from_text(text);
  return "";
}

CharCorpus CharCorpus::load(const std::string& path) {
  CharCorpus c;
  std::string err = try_load(path, &c);
  if (!err.empty()) throw Error(err);
  return c;
}

CharCorpus CharCorpus::from_text(const std::string& text) {
  FF_CHECK(text.size() >= 2, "CharCorpus: a corpus needs at least 2 bytes, got " << text.size());
  CharCorpus c;
  c.text_ = text;
  bool seen[256] = {};
  for (unsigned char b : text) seen[b] = true;
  for (int b = 0; b < 256; b++) {
    c.id_of_[b] = seen[b] ? (int64_t)c.vocab_.size() : -1;
    if (seen[b]) c.vocab_.push_back((char)b);
  }
  return c;
}

int64_t CharCorpus::split_size(Split s) const {
  int64_t train = size() * 9 / 10;
  return s == Split::train ? train : size() - train;
}

std::vector<int64_t> CharCorpus::encode(const std::string& text) const {
  std::vector<int64_t> ids(text.size());
  for (size_t i = 0; i < text.size(); i++) {
    int64_t id = id_of_[(unsigned char)text[i]];
    FF_CHECK(id >= 0, "encode: byte " << (int)(unsigned char)text[i] << " at position " << i
                                      << " is not in the corpus' vocabulary");
    ids[i] = id;
  }
  return ids;
}

std::string CharCorpus::decode(const std::vector<int64_t>& ids) const {
  std::string text(ids.size(), '\0');
  for (size_t i = 0; i < ids.size(); i++) {
    FF_CHECK(ids[i] >= 0 && ids[i] < vocab_size(), "decode: id " << ids[i] << " at position " << i
                                                       << " is outside [0, " << vocab_size() << ")");
    text[i] = vocab_[(size_t)ids[i]];
  }
  return text;
}

CharCorpus::Batch CharCorpus::batch(Split split, int64_t step, int64_t B, int64_t L, int64_t row0,
                                    int64_t row1, uint64_t seed) const {
  const int64_t n = split_size(split), begin = split == Split::train ? 0 : size() - n;
  FF_CHECK(step >= 0 && 0 <= row0 && row0 <= row1 && row1 <= B,
           "CharCorpus::batch: rows [" << row0 << ", " << row1 << ") of a batch of " << B
                                       << " at step " << step);
  FF_CHECK(L >= 1 && L < n, "CharCorpus::batch: sequence length " << L << " needs 1 <= L < "
                                << n << ", the bytes of the " << (split == Split::train ? "train" : "val")
                                << " split");
  // One stream per (seed, split, step), counter = the global row: randint's element r is a
  // function of (stream, r) alone. The odd multiplier makes the stream injective in the step.
  uint64_t stream = seed + 0x9E3779B97F4A7C15ull * (2 * (uint64_t)step + (split == Split::val));
  std::vector<int64_t> start = randint({row1}, stream, n - L).to_index_vector();
  const int64_t rows = row1 - row0;
  std::vector<int64_t> in((size_t)(rows * L)), tg((size_t)(rows * L));
  for (int64_t r = 0; r < rows; r++)
    for (int64_t j = 0; j < L; j++) {
      size_t at = (size_t)(begin + start[(size_t)(row0 + r)] + j);
      in[(size_t)(r * L + j)] = id_of_[(unsigned char)text_[at]];
      tg[(size_t)(r * L + j)] = id_of_[(unsigned char)text_[at + 1]];
    }
  return {Tensor::from_indices(in, {rows, L}), Tensor::from_indices(tg, {rows, L})};
}

uint32_t CharCorpus::crc32() const {
  return (uint32_t)::crc32(::crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(text_.data()), (uInt)text_.size());
}

}  // namespace ff
