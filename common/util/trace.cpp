// common/util/trace.cpp — per-rank spans and flights, gathered to rank 0 and written as
// Chrome-trace JSON (https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU,
// the "Trace Event Format": complete events ph "X" for spans, nestable async events ph "b"/"e"
// for flights, metadata events ph "M" for track names) and as CSV.
#include "common/util/trace.h"

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>

#include "common/util/error.h"
#include "common/util/files.h"

namespace ff {

static int rank_of(MPI_Comm comm) {
  int r = 0;
  mpiCheck(MPI_Comm_rank(comm, &r));
  return r;
}
static int size_of(MPI_Comm comm) {
  int n = 0;
  mpiCheck(MPI_Comm_size(comm, &n));
  return n;
}

Trace& trace() {
  static Trace t;
  return t;
}

// ----------------------------------------------------------------------------
// recording

const char* span_kind_name(SpanKind k) { return k == SpanKind::flight ? "flight" : "span"; }

void Trace::enable(MPI_Comm comm) {
  // A raw barrier: Comm's would try to record a span into a trace half enabled.
  mpiCheck(MPI_Barrier(comm));
  epoch_s_ = MPI_Wtime();
  next_id_ = (uint64_t)rank_of(comm) << 32;  // flight ids unique across ranks, never 0
  enabled_ = true;
}

double Trace::now_us() const { return (MPI_Wtime() - epoch_s_) * 1e6; }

void Trace::add(const std::string& name, const std::string& stream, double start_us, double end_us,
                int64_t bytes) {
  Span s;
  s.name = name;
  s.stream = stream;
  s.start_us = start_us;
  s.end_us = end_us;
  s.bytes = bytes;
  add(std::move(s));
}

void Trace::add(Span s) {
  if (!category_.empty()) s.stream = category_;
  if (s.kind == SpanKind::flight && s.id == 0) s.id = ++next_id_;
  spans_.push_back(std::move(s));
}

Trace::Scope::Scope(Trace& t, std::string name, std::string stream, int64_t bytes)
    : t_(t), name_(std::move(name)),
      stream_(t.category().empty() ? std::move(stream) : t.category()),  // the category now
      bytes_(bytes), start_(t.enabled() ? t.now_us() : 0.0) {}

Trace::Scope::~Scope() {
  if (!t_.enabled()) return;
  Span s;
  s.name = name_;
  s.stream = stream_;
  s.start_us = start_;
  s.end_us = t_.now_us();
  s.bytes = bytes_;
  t_.spans_.push_back(std::move(s));  // as captured: a Category begun since does not apply
}

Trace::Category::Category(Trace& t, std::string name) : t_(t), previous_(t.category_) {
  FF_CHECK(!name.empty(), "Trace::Category: the name must not be empty");
  t_.category_ = std::move(name);
}

Trace::Category::~Category() { t_.category_ = previous_; }

// ----------------------------------------------------------------------------
// gathering: each rank's records as one byte string, MPI_Gatherv'd to rank 0

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

std::vector<std::pair<int, Span>> Trace::gather(MPI_Comm comm) const {
  std::vector<char> mine;
  for (const Span& s : spans_) {
    put_string(mine, s.name);
    put_string(mine, s.stream);
    put_bytes(mine, &s.start_us, sizeof s.start_us);
    put_bytes(mine, &s.end_us, sizeof s.end_us);
    put_bytes(mine, &s.bytes, sizeof s.bytes);
    put_bytes(mine, &s.kind, sizeof s.kind);
    put_bytes(mine, &s.peer, sizeof s.peer);
    put_bytes(mine, &s.tag, sizeof s.tag);
    put_bytes(mine, &s.from, sizeof s.from);
    put_bytes(mine, &s.id, sizeof s.id);
  }
  // Every rank learns every size, so all of them agree on refusing an oversized gather.
  const int P = size_of(comm), rank = rank_of(comm);
  int64_t my_size = (int64_t)mine.size();
  std::vector<int64_t> sizes(P);
  mpiCheck(MPI_Allgather(&my_size, 1, MPI_INT64_T, sizes.data(), 1, MPI_INT64_T, comm));
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
                       MPI_BYTE, 0, comm));

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
      in.get(&s.kind, sizeof s.kind);
      in.get(&s.peer, sizeof s.peer);
      in.get(&s.tag, sizeof s.tag);
      in.get(&s.from, sizeof s.from);
      in.get(&s.id, sizeof s.id);
      out.emplace_back(r, std::move(s));
    }
  }
  return out;
}

// ----------------------------------------------------------------------------
// writing (rank 0), through OutputFile: every write checked, the file renamed into place whole

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

// A peer as text: a rank, "all" for a collective, "" for none.
static std::string peer_text(int peer) {
  if (peer == Span::kNoPeer) return "";
  if (peer == Span::kAllRanks) return "all";
  return std::to_string(peer);
}
static std::string tag_text(int tag) { return tag == Span::kNoTag ? "" : std::to_string(tag); }

// JSON args: bytes always; peer, tag and from when there are.
static std::string json_args(const Span& s) {
  std::string a = "{\"bytes\": " + std::to_string(s.bytes);
  if (s.peer == Span::kAllRanks) a += ", \"peer\": \"all\"";
  else if (s.peer != Span::kNoPeer) a += ", \"peer\": " + std::to_string(s.peer);
  if (s.tag != Span::kNoTag) a += ", \"tag\": " + std::to_string(s.tag);
  if (s.from != Span::kNoPeer) a += ", \"from\": " + std::to_string(s.from);
  return a + "}";
}

// Times as written (%.3f): the end is rounded on its own and the duration taken between the
// rounded ends, so two spans that nest in memory still nest in the file. Records before the
// epoch are clipped to it.
static double round_us(double t) { return std::round(t * 1000.0) / 1000.0; }

void Trace::write_chrome_json(MPI_Comm comm, const std::string& path) const {
  std::vector<std::pair<int, Span>> all = gather(comm);
  if (rank_of(comm) != 0) return;

  // One thread track per stream, the same tid on every rank: compute first, comm second,
  // any other stream (a category such as "check") after them in order of first appearance.
  std::map<std::string, int> tid{{"compute", 1}, {"comm", 2}};
  std::vector<std::string> streams{"compute", "comm"};
  std::set<std::pair<int, std::string>> used;  // (rank, stream) pairs that get a named track
  for (const auto& rs : all) {
    if (tid.emplace(rs.second.stream, (int)tid.size() + 1).second) streams.push_back(rs.second.stream);
    used.emplace(rs.first, rs.second.stream);
  }

  OutputFile f(path);
  f.printf("{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n");
  const char* sep = "";
  for (int r = 0; r < size_of(comm); r++) {
    f.printf("%s{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": 0, "
             "\"args\": {\"name\": \"rank %d\"}}", sep, r, r);
    sep = ",\n";
    f.printf("%s{\"name\": \"process_sort_index\", \"ph\": \"M\", \"pid\": %d, \"tid\": 0, "
             "\"args\": {\"sort_index\": %d}}", sep, r, r);
    for (const std::string& s : streams) {
      if (!used.count({r, s})) continue;
      f.printf("%s{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": %d, "
               "\"args\": {\"name\": \"%s\"}}", sep, r, tid[s], json_escape(s).c_str());
      f.printf("%s{\"name\": \"thread_sort_index\", \"ph\": \"M\", \"pid\": %d, \"tid\": %d, "
               "\"args\": {\"sort_index\": %d}}", sep, r, tid[s], tid[s]);
    }
  }
  for (const auto& [r, s] : all) {
    const double start = round_us(s.start_us > 0 ? s.start_us : 0.0);
    const double end = std::max(start, round_us(s.end_us));
    const std::string name = json_escape(s.name), cat = json_escape(s.stream), args = json_args(s);
    if (s.kind == SpanKind::span) {
      f.printf("%s{\"name\": \"%s\", \"cat\": \"%s\", \"ph\": \"X\", \"ts\": %.3f, \"dur\": %.3f, "
               "\"pid\": %d, \"tid\": %d, \"args\": %s}",
               sep, name.c_str(), cat.c_str(), start, end - start, r, tid[s.stream], args.c_str());
    } else {  // a flight: begin and end of one async slice, matched by (cat, id)
      f.printf("%s{\"name\": \"%s\", \"cat\": \"%s\", \"ph\": \"b\", \"id\": %llu, \"ts\": %.3f, "
               "\"pid\": %d, \"tid\": %d, \"args\": %s}",
               sep, name.c_str(), cat.c_str(), (unsigned long long)s.id, start, r, tid[s.stream],
               args.c_str());
      f.printf("%s{\"name\": \"%s\", \"cat\": \"%s\", \"ph\": \"e\", \"id\": %llu, \"ts\": %.3f, "
               "\"pid\": %d, \"tid\": %d}",
               sep, name.c_str(), cat.c_str(), (unsigned long long)s.id, end, r, tid[s.stream]);
    }
  }
  f.printf("\n]}\n");
  f.commit();
}

void Trace::write_csv(MPI_Comm comm, const std::string& path) const {
  std::vector<std::pair<int, Span>> all = gather(comm);
  if (rank_of(comm) != 0) return;
  OutputFile f(path);
  f.printf("rank,name,stream,start_us,end_us,bytes,kind,peer,tag,from\n");
  for (const auto& [r, s] : all)
    f.printf("%d,%s,%s,%.3f,%.3f,%lld,%s,%s,%s,%s\n", r, csv_field(s.name).c_str(),
             csv_field(s.stream).c_str(), s.start_us, s.end_us, (long long)s.bytes,
             span_kind_name(s.kind), peer_text(s.peer).c_str(),
             tag_text(s.tag).c_str(), peer_text(s.from).c_str());
  f.commit();
}

}  // namespace ff
