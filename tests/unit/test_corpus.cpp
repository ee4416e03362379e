// CharCorpus (common/lesson/corpus.h): the vocabulary of data/tinyshakespeare.txt, encode and
// decode, the train/val split, and batches whose rows are the same bits whatever slice of the
// global batch a rank builds (the binary runs from the repository root).
#include <doctest/doctest.h>

#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "common/core/check.h"
#include "common/lesson/corpus.h"

using namespace ff;
using Split = CharCorpus::Split;

namespace {

const std::string kShakespeare = "data/tinyshakespeare.txt";

const CharCorpus& shakespeare() {
  static const CharCorpus c = [] {
    REQUIRE_MESSAGE(std::filesystem::is_regular_file(kShakespeare),
                    kShakespeare << " not found: run the tests from the repository root");
    return CharCorpus::load(kShakespeare);
  }();
  return c;
}

std::string bytes_of(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  REQUIRE(f);
  std::string s;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) s.append(buf, n);
  std::fclose(f);
  return s;
}

// The rows of int64 tensors one after another (a rank's slices, gathered).
std::vector<int64_t> concat_rows(const std::vector<Tensor>& parts) {
  std::vector<int64_t> all;
  for (const Tensor& t : parts) {
    std::vector<int64_t> v = t.to_index_vector();
    all.insert(all.end(), v.begin(), v.end());
  }
  return all;
}

}  // namespace

TEST_CASE("corpus: the vocabulary of tinyshakespeare is its 65 distinct bytes, sorted") {
  const CharCorpus& c = shakespeare();
  std::string text = bytes_of(kShakespeare);
  std::set<unsigned char> distinct(text.begin(), text.end());  // counted here, independently
  CHECK(c.size() == 1115394);
  CHECK(c.size() == (int64_t)text.size());
  CHECK(distinct.size() == 65);
  CHECK(c.vocab_size() == (int64_t)distinct.size());
  CHECK(c.vocab() == std::string(distinct.begin(), distinct.end()));
  CHECK(c.vocab().front() == '\n');
  CHECK(c.vocab().substr(1, 1) == " ");
  CHECK(c.vocab().back() == 'z');
  // train = the first 90% (as nanoGPT splits it), val = the rest
  CHECK(c.split_size(Split::train) == 1003854);
  CHECK(c.split_size(Split::val) == 111540);
}

TEST_CASE("corpus: encode and decode are inverse, and ids are places in the vocabulary") {
  const CharCorpus& c = shakespeare();
  std::string text = bytes_of(kShakespeare).substr(0, 5000);
  std::vector<int64_t> ids = c.encode(text);
  REQUIRE(ids.size() == text.size());
  for (size_t i = 0; i < ids.size(); i++) REQUIRE(c.vocab()[(size_t)ids[i]] == text[i]);
  CHECK(c.decode(ids) == text);
  CHECK(c.encode("\n") == std::vector<int64_t>{0});
  CHECK_THROWS_WITH_AS(c.encode("caf\xc3\xa9"), doctest::Contains("byte 195 at position 3"), Error);
  CHECK_THROWS_WITH_AS(c.decode({0, 65}), doctest::Contains("id 65 at position 1"), Error);
}

TEST_CASE("corpus: targets are the inputs shifted by one, from the split's own bytes") {
  const CharCorpus& c = shakespeare();
  std::string text = bytes_of(kShakespeare);
  const int64_t B = 8, L = 64;
  for (Split s : {Split::train, Split::val}) {
    CharCorpus::Batch b = c.batch(s, 3, B, L, 0, B, 1234);
    REQUIRE(b.inputs.shape() == Shape{B, L});
    REQUIRE(b.targets.shape() == Shape{B, L});
    CHECK(b.inputs.dtype() == DType::i64);
    CHECK(b.inputs.device() == Device::cpu);
    std::vector<int64_t> in = b.inputs.to_index_vector(), tg = b.targets.to_index_vector();
    const int64_t n_train = c.split_size(Split::train);
    for (int64_t r = 0; r < B; r++) {
      std::vector<int64_t> row_in(in.begin() + r * L, in.begin() + (r + 1) * L);
      std::vector<int64_t> row_tg(tg.begin() + r * L, tg.begin() + (r + 1) * L);
      // the row (plus its last target) is a contiguous piece of the split
      std::string piece = c.decode(row_in) + c.decode({row_tg.back()});
      size_t at = s == Split::train ? text.find(piece) : text.find(piece, (size_t)n_train);
      REQUIRE(at != std::string::npos);
      if (s == Split::train) CHECK(at + piece.size() <= (size_t)n_train);
      for (int64_t j = 0; j + 1 < L; j++) CHECK(row_tg[(size_t)j] == row_in[(size_t)j + 1]);
    }
  }
}

TEST_CASE("corpus: any slice of a batch equals those rows of the whole batch, bit for bit") {
  const CharCorpus& c = shakespeare();
  const int64_t B = 12, L = 32;
  const uint64_t seed = 99;
  CharCorpus::Batch whole = c.batch(Split::train, 7, B, L, 0, B, seed);
  // every world size from 1 to B, split as split_range splits rows among ranks
  for (int64_t P = 1; P <= B; P++) {
    std::vector<Tensor> in, tg;  // the ranks' slices, in rank order
    for (int64_t r = 0; r < P; r++) {
      int64_t r0, r1;
      split_range(B, P, r, &r0, &r1);
      CharCorpus::Batch part = c.batch(Split::train, 7, B, L, r0, r1, seed);
      CHECK(part.inputs.shape() == Shape{r1 - r0, L});
      in.push_back(part.inputs);
      tg.push_back(part.targets);
    }
    INFO("world size " << P);
    CHECK(concat_rows(in) == whole.inputs.to_index_vector());
    CHECK(concat_rows(tg) == whole.targets.to_index_vector());
  }
}

TEST_CASE("corpus: different steps, seeds and splits give different batches; the same give the same") {
  const CharCorpus& c = shakespeare();
  const int64_t L = 64;
  auto rows = [&](Split s, int64_t step, uint64_t seed) {
    return c.batch(s, step, 4, L, 0, 4, seed).inputs.to_index_vector();
  };
  CHECK(rows(Split::train, 0, 1) == rows(Split::train, 0, 1));
  CHECK(rows(Split::train, 0, 1) != rows(Split::train, 1, 1));
  CHECK(rows(Split::train, 1, 1) != rows(Split::train, 2, 1));
  CHECK(rows(Split::train, 0, 1) != rows(Split::train, 0, 2));
  CHECK(rows(Split::train, 0, 1) != rows(Split::val, 0, 1));
  // over 100 steps the starts spread over the split: no repeated row
  std::set<std::vector<int64_t>> seen;
  for (int64_t step = 0; step < 100; step++) {
    std::vector<int64_t> v = rows(Split::train, step, 5);
    for (int64_t r = 0; r < 4; r++)
      seen.insert(std::vector<int64_t>(v.begin() + r * L, v.begin() + (r + 1) * L));
  }
  CHECK(seen.size() == 400);
}

TEST_CASE("corpus: a small text, and every start offset reachable up to the last byte") {
  CharCorpus c = CharCorpus::from_text("abcdefghijklmnopqrst");  // train 18 bytes, val 2
  CHECK(c.vocab_size() == 20);
  CHECK(c.split_size(Split::train) == 18);
  CHECK(c.split_size(Split::val) == 2);
  // L = 17: the only train window is a..q -> b..r; val L = 1: s -> t
  CHECK(c.decode(c.batch(Split::train, 0, 1, 17, 0, 1, 3).inputs.to_index_vector()) ==
        "abcdefghijklmnopq");
  CHECK(c.decode(c.batch(Split::train, 0, 1, 17, 0, 1, 3).targets.to_index_vector()) ==
        "bcdefghijklmnopqr");
  CHECK(c.decode(c.batch(Split::val, 5, 1, 1, 0, 1, 3).targets.to_index_vector()) == "t");
  // L = 1 over 200 rows: every start 0..16 appears, never 17 (its target would be in val)
  std::set<std::string> starts;
  for (int64_t step = 0; step < 20; step++)
    for (char ch : c.decode(c.batch(Split::train, step, 10, 1, 0, 10, 8).inputs.to_index_vector()))
      starts.insert(std::string(1, ch));
  CHECK(starts.size() == 17);
  CHECK(starts.count("r") == 0);
  CHECK_THROWS_WITH_AS(c.batch(Split::train, 0, 1, 18, 0, 1, 3),
                       doctest::Contains("sequence length 18 needs 1 <= L < 18"), Error);
  CHECK_THROWS_WITH_AS(c.batch(Split::train, 0, 4, 2, 3, 5, 3), doctest::Contains("rows [3, 5)"),
                       Error);
}

TEST_CASE("corpus: a file that cannot be read is one error naming it and the reason") {
  CharCorpus c;
  CHECK(CharCorpus::try_load("no/such/file.txt", &c) ==
        "cannot read no/such/file.txt: No such file or directory");
  CHECK_THROWS_WITH_AS(CharCorpus::load("no/such/file.txt"),
                       "cannot read no/such/file.txt: No such file or directory", Error);
  CHECK(CharCorpus::try_load("data", &c) == "cannot read data: Is a directory");
  CHECK(CharCorpus::try_load("/dev/null", &c) == "/dev/null has 0 bytes: a corpus needs at least 2");
  CHECK(CharCorpus::try_load(kShakespeare, &c) == "");
  CHECK(c.vocab_size() == 65);
}
