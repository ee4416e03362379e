// common/core/npy.cpp — .npy versions 1.0 to 3.0: the header dict parser, the reader that checks every
// size before it allocates, and a writer (version 1.0) that produces
// the same bytes as numpy's np.save.
#include "common/core/npy.h"

#include "common/util/files.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>

#include "common/core/check.h"

namespace ff {

// Every error names the file first: "<path>: <what is wrong>".
#define NPY_CHECK(cond, msg) FF_CHECK(cond, path << ": " << msg)

static const char kMagic[] = "\x93NUMPY";  // 6 bytes
static const size_t kMagicLen = 6;
static const size_t kPreludeLen = 10;     // magic, major, minor, uint16 header length
static const size_t kAlign = 64;          // numpy's ARRAY_ALIGN: data starts at a multiple
static const size_t kMaxDims = 8;         // more is refused as absurd (numpy allows 64)
static const size_t kGrowthDigits = 21;   // numpy's GROWTH_AXIS_MAX_DIGITS (spare header room)
static const char kSupported[] = "'<f4' float32, '<i4' int32, '<i8' int64";

static bool host_is_little_endian() {
  const uint16_t one = 1;
  unsigned char first;
  std::memcpy(&first, &one, 1);
  return first == 1;
}

size_t npy_itemsize(const std::string& descr) {
  if (descr == "<f4" || descr == "<i4") return 4;
  if (descr == "<i8") return 8;
  FF_CHECK(false, "unsupported .npy dtype '" << descr << "' (supported: " << kSupported << ")");
  return 0;
}

static std::string shape_repr(const std::vector<int64_t>& shape) {  // Python's repr of a tuple
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); i++) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

// ---------------------------------------------------------------------------
// the header dict: {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
//
// A small recursive-descent parser for exactly the Python literals numpy writes there:
// quoted strings, True/False, and tuples of non-negative integers. Keys in any order,
// each once, a trailing comma allowed, only whitespace after the closing brace.

namespace {
struct NpyHeader {
  std::string descr;
  bool fortran_order = false;
  std::vector<int64_t> shape;
};

class HeaderParser {
 public:
  HeaderParser(const std::string& path, const std::string& text) : path(path), s_(text) {}

  NpyHeader parse() {
    NpyHeader h;
    bool have_descr = false, have_fortran = false, have_shape = false;
    skip_space();
    expect('{');
    for (;;) {
      skip_space();
      if (peek() == '}') break;
      std::string key = parse_string("a key");
      skip_space();
      expect(':');
      skip_space();
      if (key == "descr") {
        NPY_CHECK(!have_descr, malformed("'descr' appears twice"));
        NPY_CHECK(peek() != '[', "unsupported dtype: a structured dtype (supported: " << kSupported << ")");
        h.descr = parse_string("the 'descr' value");
        have_descr = true;
      } else if (key == "fortran_order") {
        NPY_CHECK(!have_fortran, malformed("'fortran_order' appears twice"));
        h.fortran_order = parse_bool();
        have_fortran = true;
      } else if (key == "shape") {
        NPY_CHECK(!have_shape, malformed("'shape' appears twice"));
        h.shape = parse_shape();
        have_shape = true;
      } else {
        NPY_CHECK(false, malformed("unexpected key '" + key + "'"));
      }
      skip_space();
      if (peek() == ',') {
        pos_++;
        continue;
      }
      NPY_CHECK(peek() == '}', malformed("expected ',' or '}' at offset " + std::to_string(pos_)));
    }
    pos_++;  // '}'
    skip_space();
    NPY_CHECK(pos_ == s_.size(), malformed("unexpected text after the closing '}'"));
    NPY_CHECK(have_descr && have_fortran && have_shape,
              malformed(std::string("missing key '") +
                        (!have_descr ? "descr" : !have_fortran ? "fortran_order" : "shape") + "'"));
    return h;
  }

 private:
  const std::string& path;  // named `path` for NPY_CHECK
  const std::string& s_;
  size_t pos_ = 0;

  std::string malformed(const std::string& what) const {
    std::string shown = s_;
    while (!shown.empty() && (shown.back() == ' ' || shown.back() == '\n')) shown.pop_back();
    if (shown.size() > 120) shown = shown.substr(0, 120) + "...";
    for (char& c : shown)
      if (c < 0x20 || c > 0x7e) c = '?';
    return "malformed header dict: " + what + " in \"" + shown + "\"";
  }

  char peek() const { return pos_ < s_.size() ? s_[pos_] : '\0'; }
  void skip_space() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r'))
      pos_++;
  }
  void expect(char c) {
    NPY_CHECK(peek() == c, malformed(std::string("expected '") + c + "' at offset " + std::to_string(pos_)));
    pos_++;
  }
  std::string parse_string(const char* what) {
    char q = peek();
    NPY_CHECK(q == '\'' || q == '"', malformed(std::string("expected a quoted string for ") + what +
                                                " at offset " + std::to_string(pos_)));
    size_t end = s_.find(q, pos_ + 1);
    NPY_CHECK(end != std::string::npos, malformed("unterminated string"));
    std::string v = s_.substr(pos_ + 1, end - pos_ - 1);
    pos_ = end + 1;
    return v;
  }
  bool parse_bool() {
    if (s_.compare(pos_, 4, "True") == 0) {
      pos_ += 4;
      return true;
    }
    if (s_.compare(pos_, 5, "False") == 0) {
      pos_ += 5;
      return false;
    }
    NPY_CHECK(false, malformed("'fortran_order' must be True or False"));
    return false;
  }
  int64_t parse_dim() {
    NPY_CHECK(peek() != '-', "absurd shape: negative dimension at offset " << pos_ << " of the header");
    NPY_CHECK(peek() >= '0' && peek() <= '9', malformed("expected a dimension at offset " + std::to_string(pos_)));
    int64_t v = 0;
    while (peek() >= '0' && peek() <= '9') {
      int digit = peek() - '0';
      NPY_CHECK(v <= (INT64_MAX - digit) / 10, "absurd shape: a dimension does not fit in 64 bits");
      v = v * 10 + digit;
      pos_++;
    }
    if (peek() == 'L') pos_++;  // Python 2 wrote long integers as 3L
    return v;
  }
  std::vector<int64_t> parse_shape() {
    std::vector<int64_t> shape;
    expect('(');
    skip_space();
    bool trailing_comma = false;
    while (peek() != ')') {
      shape.push_back(parse_dim());
      NPY_CHECK(shape.size() <= kMaxDims, "absurd shape: more than " << kMaxDims << " dimensions");
      skip_space();
      trailing_comma = false;
      if (peek() == ',') {
        pos_++;
        trailing_comma = true;
        skip_space();
      } else {
        NPY_CHECK(peek() == ')', malformed("expected ',' or ')' in the shape at offset " + std::to_string(pos_)));
      }
    }
    pos_++;  // ')'
    // (3) is the integer 3 in Python, not a tuple: a 1-d shape is written (3,)
    NPY_CHECK(shape.size() != 1 || trailing_comma, malformed("the shape is not a tuple"));
    return shape;
  }
};
}  // namespace

// ---------------------------------------------------------------------------
// reading

NpyInfo read_npy_info(const std::string& path) {
  NPY_CHECK(host_is_little_endian(), "this reader assumes a little-endian host");
  struct stat st;
  NPY_CHECK(::stat(path.c_str(), &st) == 0, "cannot open .npy file: " << std::strerror(errno));
  NPY_CHECK(!S_ISDIR(st.st_mode), "is a directory, not a .npy file");
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  NPY_CHECK(f, "cannot open .npy file: " << std::strerror(errno));
  const uint64_t file_size = (uint64_t)st.st_size;

  // magic, version, header length: version 1.0 stores it in 2 bytes, 2.0 and 3.0 in 4 (3.0's
  // header is UTF-8, of which the dict's literals here are the ASCII part). The data start right
  // after the header, wherever that is: numpy pads to 64 bytes, other writers to more.
  unsigned char prelude[kPreludeLen + 2] = {};
  size_t got = std::fread(prelude, 1, kPreludeLen, f.get());
  NPY_CHECK(std::memcmp(prelude, kMagic, std::min(got, kMagicLen)) == 0 && got > 0,
            "not a .npy file (it does not start with the magic bytes \\x93NUMPY)");
  NPY_CHECK(got == kPreludeLen, "truncated header: the file has only " << got << " bytes");
  const int major = prelude[6], minor = prelude[7];
  NPY_CHECK((major == 1 || major == 2 || major == 3) && minor == 0,
            "unsupported .npy format version " << major << "." << minor << " (supported: 1.0, 2.0, 3.0)");
  size_t prelude_len = kPreludeLen, header_len = (size_t)prelude[8] | ((size_t)prelude[9] << 8);  // little-endian
  if (major > 1) {
    NPY_CHECK(std::fread(prelude + kPreludeLen, 1, 2, f.get()) == 2,
              "truncated header: the file has only " << kPreludeLen << " bytes");
    prelude_len += 2;
    header_len |= ((size_t)prelude[10] << 16) | ((size_t)prelude[11] << 24);
  }
  NPY_CHECK(file_size >= prelude_len + header_len,
            "truncated header: it says " << header_len << " bytes but the file has only "
                                         << file_size - prelude_len << " after the prelude");
  std::string text(header_len, '\0');
  NPY_CHECK(header_len == 0 || std::fread(&text[0], 1, header_len, f.get()) == header_len,
            "read error in the header: " << std::strerror(errno));

  NpyHeader h = HeaderParser(path, text).parse();
  NPY_CHECK(h.descr == "<f4" || h.descr == "<i4" || h.descr == "<i8",
            "unsupported dtype '" << h.descr << "' (supported: " << kSupported << ")");
  NPY_CHECK(!h.fortran_order, "fortran_order True (column-major) is not supported; save a C-order "
                              "array (np.ascontiguousarray)");

  // sizes, checked before anything is allocated
  const uint64_t itemsize = npy_itemsize(h.descr);
  uint64_t need = itemsize;
  for (int64_t d : h.shape)
    NPY_CHECK(!__builtin_mul_overflow(need, (uint64_t)d, &need),
              "absurd shape " << shape_repr(h.shape) << ": its size in bytes overflows 64 bits");
  const uint64_t have = file_size - prelude_len - header_len;
  NPY_CHECK(need <= have, "truncated data: shape " << shape_repr(h.shape) << " of " << h.descr
                                                   << " needs " << need << " bytes, the file has "
                                                   << have << " after the header");
  NPY_CHECK(need == have, "trailing garbage: " << have - need << " bytes after the data of shape "
                                               << shape_repr(h.shape) << " of " << h.descr);

  NpyInfo info;
  info.descr = h.descr;
  info.shape = h.shape;
  info.data_offset = prelude_len + header_len;
  info.data_bytes = need;
  return info;
}

NpyArray read_npy(const std::string& path) {
  const NpyInfo info = read_npy_info(path);
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  NPY_CHECK(f, "cannot open .npy file: " << std::strerror(errno));
  NPY_CHECK(std::fseek(f.get(), (long)info.data_offset, SEEK_SET) == 0, "seek error: " << std::strerror(errno));
  NpyArray a;
  a.descr = info.descr;
  a.shape = info.shape;
  a.data.resize((size_t)info.data_bytes);
  NPY_CHECK(std::fread(a.data.data(), 1, a.data.size(), f.get()) == a.data.size(),
            "read error in the data: " << std::strerror(errno));
  return a;
}

Tensor load_npy(const std::string& path) {
  NpyArray a = read_npy(path);
  if (a.descr == "<f4") {
    Tensor t = Tensor::empty(a.shape, Device::cpu, DType::f32);
    if (!a.data.empty()) std::memcpy(t.raw(), a.data.data(), a.data.size());
    return t;
  }
  Tensor t = Tensor::empty(a.shape, Device::cpu, DType::i64);
  if (a.descr == "<i8") {
    if (!a.data.empty()) std::memcpy(t.raw(), a.data.data(), a.data.size());
  } else {  // "<i4": widen
    int64_t* out = t.index_data();
    for (int64_t i = 0; i < t.numel(); i++) {
      int32_t v;
      std::memcpy(&v, a.data.data() + 4 * i, 4);
      out[i] = v;
    }
  }
  return t;
}

// ---------------------------------------------------------------------------
// writing

// The header exactly as numpy (1.22 and later) writes it: keys sorted, spare spaces after
// the dict so the first dimension can grow in place, then padding to kAlign and '\n'.
std::string npy_header(const std::string& descr, const std::vector<int64_t>& shape) {
  std::string dict = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': " +
                     shape_repr(shape) + ", }";
  if (!shape.empty()) dict += std::string(kGrowthDigits - std::to_string(shape[0]).size(), ' ');
  size_t hlen = dict.size() + 1;  // + '\n'
  size_t pad = kAlign - (kPreludeLen + hlen) % kAlign;
  hlen += pad;
  std::string out(kMagic, kMagicLen);
  out += '\x01';
  out += '\x00';
  out += (char)(hlen & 0xff);
  out += (char)(hlen >> 8);
  return out + dict + std::string(pad, ' ') + '\n';
}

void write_npy(const std::string& path, const std::string& descr, const std::vector<int64_t>& shape,
               const std::vector<char>& data) {
  NPY_CHECK(host_is_little_endian(), "this writer assumes a little-endian host");
  NPY_CHECK(descr == "<f4" || descr == "<i4" || descr == "<i8",
            "cannot write dtype '" << descr << "' (supported: " << kSupported << ")");
  NPY_CHECK(shape.size() <= kMaxDims, "cannot write " << shape.size() << " dimensions (at most "
                                                      << kMaxDims << ")");
  uint64_t need = npy_itemsize(descr);
  for (int64_t d : shape) {
    NPY_CHECK(d >= 0, "cannot write a negative dimension in shape " << shape_repr(shape));
    NPY_CHECK(!__builtin_mul_overflow(need, (uint64_t)d, &need), "shape " << shape_repr(shape)
                                                                          << " overflows");
  }
  NPY_CHECK(need == data.size(), "write_npy: shape " << shape_repr(shape) << " of " << descr << " needs "
                                                     << need << " bytes, got " << data.size());
  std::string header = npy_header(descr, shape);
  NPY_CHECK(header.size() - kPreludeLen <= 0xffff, "header too long for .npy version 1.0");

  // Checked and atomic: a reader never sees a truncated .npy (common/util/files.h).
  OutputFile f(path);
  f.write(header);
  f.write(data.data(), data.size());
  f.commit();
}

void save_npy(const std::string& path, const Tensor& t) {
  NPY_CHECK(t.defined(), "save_npy: undefined tensor");
  NPY_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::i64,
            "save_npy: a " << dtype_name(t.dtype()) << " tensor (numpy has no such dtype: save it "
                         "widened to float32)");
  Tensor host = t.device() == Device::cpu ? t : t.to(Device::cpu);
  std::vector<char> bytes(host.nbytes());
  if (!bytes.empty()) std::memcpy(bytes.data(), host.raw(), bytes.size());
  write_npy(path, host.dtype() == DType::f32 ? "<f4" : "<i8", host.shape(), bytes);
}

}  // namespace ff
