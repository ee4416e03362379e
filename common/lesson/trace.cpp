// common/lesson/trace.cpp — per-rank spans, gathered to rank 0 and written as Chrome-trace JSON
// (https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU, the
// "Trace Event Format": complete events ph "X" plus metadata events ph "M") and as CSV.
#include "common/lesson/trace.h"

#include <mpi.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>

#include "common/core/check.h"
#include "common/comm/comm.h"

namespace ff {

Trace& trace() {
  static Trace t;
  return t;
}

// ----------------------------------------------------------------------------
// recording

void Trace::enable(const Comm& comm) {
  // A raw barrier: the Comm one would try to record a span into a trace half enabled.
  mpiCheck(MPI_Barrier(comm.raw()));
  epoch_s_ = MPI_Wtime();
  enabled_ = true;
}

double Trace::now_us() const { return (MPI_Wtime() - epoch_s_) * 1e6; }

void Trace::add(const std::string& name, const std::string& stream, double start_us, double end_us,
                int64_t bytes) {
  spans_.push_back(Span{name, stream, start_us, end_us, bytes});
}

Trace::Scope::Scope(Trace& t, std::string name, std::string stream, int64_t bytes)
    : t_(t), name_(std::move(name)), stream_(std::move(stream)), bytes_(bytes),
      start_(t.enabled() ? t.now_us() : 0.0) {}

Trace::Scope::~Scope() {
  if (t_.enabled()) t_.add(name_, stream_, start_, t_.now_us(), bytes_);
}

// ----------------------------------------------------------------------------
// gathering: each rank's spans as one byte string, MPI_Gatherv'd to rank 0

static void put_bytes(std::vector<char>& out, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  out.insert(out.end(), c, c + n);
}
static void put_string(std::vector<char>& out, const std::string& s) {
  uint32_t n = (uint32_t)s.size();
  put_bytes(out, &n, sizeof n);
  put_bytes(out, s.data(), s.size());
}

// Reads what put_* wrote, in the same order (every rank is the same binary and machine type).
struct Reader {
  const char* p;
  const char* end;
  void get(void* dst, size_t n) {
    FF_CHECK((size_t)(end - p) >= n, "trace gather: truncated span record");
    std::memcpy(dst, p, n);
    p += n;
  }
  std::string get_string() {
    uint32_t n = 0;
    get(&n, sizeof n);
    std::string s(n, '\0');
    get(&s[0], n);
    return s;
  }
};

std::vector<std::pair<int, Span>> Trace::gather(const Comm& comm) const {
  std::vector<char> mine;
  for (const Span& s : spans_) {
    put_string(mine, s.name);
    put_string(mine, s.stream);
    put_bytes(mine, &s.start_us, sizeof s.start_us);
    put_bytes(mine, &s.end_us, sizeof s.end_us);
    put_bytes(mine, &s.bytes, sizeof s.bytes);
  }
  // Every rank learns every size, so all of them agree on refusing an oversized gather.
  const int P = comm.size(), rank = comm.rank();
  int64_t my_size = (int64_t)mine.size();
  std::vector<int64_t> sizes(P);
  mpiCheck(MPI_Allgather(&my_size, 1, MPI_INT64_T, sizes.data(), 1, MPI_INT64_T, comm.raw()));
  std::vector<int> counts(P), displs(P);
  int64_t total = 0;
  for (int r = 0; r < P; r++) {
    FF_CHECK(total + sizes[r] <= INT_MAX, "trace gather: more than " << INT_MAX << " bytes of spans");
    counts[r] = (int)sizes[r];
    displs[r] = (int)total;
    total += sizes[r];
  }
  std::vector<char> all(rank == 0 ? (size_t)total : 0);
  mpiCheck(MPI_Gatherv(mine.data(), (int)my_size, MPI_BYTE, all.data(), counts.data(), displs.data(),
                       MPI_BYTE, 0, comm.raw()));

  std::vector<std::pair<int, Span>> out;
  if (rank != 0) return out;
  for (int r = 0; r < P; r++) {
    Reader in{all.data() + displs[r], all.data() + displs[r] + counts[r]};
    while (in.p < in.end) {
      Span s;
      s.name = in.get_string();
      s.stream = in.get_string();
      in.get(&s.start_us, sizeof s.start_us);
      in.get(&s.end_us, sizeof s.end_us);
      in.get(&s.bytes, sizeof s.bytes);
      out.emplace_back(r, std::move(s));
    }
  }
  return out;
}

// ----------------------------------------------------------------------------
// writing (rank 0)

static FILE* open_for_writing(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) throw Error("cannot write trace file " + path + ": " + std::strerror(errno));
  return f;
}

static void close_written(FILE* f, const std::string& path) {
  bool bad = std::ferror(f) != 0;
  int saved = errno;
  if (std::fclose(f) != 0 && !bad) {
    bad = true;
    saved = errno;
  }
  if (bad) throw Error("cannot write trace file " + path + ": " + std::strerror(saved));
}

static std::string json_escape(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += (char)c;
        }
    }
  }
  return out;
}

// RFC 4180: quote a field that holds a comma, a quote or a line break; double the quotes.
static std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n\r") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

void Trace::write_chrome_json(const Comm& comm, const std::string& path) const {
  std::vector<std::pair<int, Span>> all = gather(comm);
  if (comm.rank() != 0) return;

  // One thread track per stream, the same tid on every rank: compute first, comm second,
  // any other stream after them in order of first appearance.
  std::map<std::string, int> tid{{"compute", 1}, {"comm", 2}};
  std::vector<std::string> streams{"compute", "comm"};
  std::set<std::pair<int, std::string>> used;  // (rank, stream) pairs that get a named track
  for (const auto& rs : all) {
    if (tid.emplace(rs.second.stream, (int)tid.size() + 1).second) streams.push_back(rs.second.stream);
    used.emplace(rs.first, rs.second.stream);
  }

  FILE* f = open_for_writing(path);
  std::fprintf(f, "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n");
  const char* sep = "";
  for (int r = 0; r < comm.size(); r++) {
    std::fprintf(f, "%s{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": 0, "
                    "\"args\": {\"name\": \"rank %d\"}}", sep, r, r);
    sep = ",\n";
    std::fprintf(f, "%s{\"name\": \"process_sort_index\", \"ph\": \"M\", \"pid\": %d, \"tid\": 0, "
                    "\"args\": {\"sort_index\": %d}}", sep, r, r);
    for (const std::string& s : streams) {
      if (!used.count({r, s})) continue;
      std::fprintf(f, "%s{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": %d, "
                      "\"args\": {\"name\": \"%s\"}}", sep, r, tid[s], json_escape(s).c_str());
      std::fprintf(f, "%s{\"name\": \"thread_sort_index\", \"ph\": \"M\", \"pid\": %d, \"tid\": %d, "
                      "\"args\": {\"sort_index\": %d}}", sep, r, tid[s], tid[s]);
    }
  }
  for (const auto& [r, s] : all) {
    double dur = s.end_us > s.start_us ? s.end_us - s.start_us : 0.0;
    std::fprintf(f, "%s{\"name\": \"%s\", \"cat\": \"%s\", \"ph\": \"X\", \"ts\": %.3f, "
                    "\"dur\": %.3f, \"pid\": %d, \"tid\": %d, \"args\": {\"bytes\": %lld}}",
                 sep, json_escape(s.name).c_str(), json_escape(s.stream).c_str(),
                 s.start_us > 0 ? s.start_us : 0.0, dur, r, tid[s.stream], (long long)s.bytes);
  }
  std::fprintf(f, "\n]}\n");
  close_written(f, path);
}

void Trace::write_csv(const Comm& comm, const std::string& path) const {
  std::vector<std::pair<int, Span>> all = gather(comm);
  if (comm.rank() != 0) return;
  FILE* f = open_for_writing(path);
  std::fprintf(f, "rank,name,stream,start_us,end_us,bytes\n");
  for (const auto& [r, s] : all)
    std::fprintf(f, "%d,%s,%s,%.3f,%.3f,%lld\n", r, csv_field(s.name).c_str(),
                 csv_field(s.stream).c_str(), s.start_us, s.end_us, (long long)s.bytes);
  close_written(f, path);
}

}  // namespace ff
