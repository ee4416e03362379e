// common/comm/link.cpp — the link model: its flag, parse_link ("intra=BW,inter=BW,latency=T"),
// describe (one line for a lesson's output), and at run time the state of this rank's links,
// each message's modelled completion (link_posted, link_arrived) and when it is due. The waits
// it delays are in watchdog.cpp.
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/comm/comm.h"
#include "common/comm/comm_detail.h"

#include <algorithm>
#include <chrono>

namespace ff {

const char* link_class_name(LinkClass c) {
  return c == LinkClass::self ? "self" : c == LinkClass::intra ? "intra" : "inter";
}

namespace {

struct Unit {
  const char* name;
  double scale;  // to bytes per second, or to seconds
};
const Unit kBandwidthUnits[] = {{"GB/s", 1e9}, {"MB/s", 1e6}, {"KB/s", 1e3}, {"B/s", 1}};
const Unit kTimeUnits[] = {{"s", 1}, {"ms", 1e-3}, {"us", 1e-6}, {"ns", 1e-9}};

// A decimal number at the start of s: digits with an optional fraction and exponent (no sign,
// no hex, no inf or nan). Returns its length, 0 if s does not start with one.
size_t number_length(const std::string& s) {
  size_t i = 0, digits = 0;
  while (i < s.size() && std::isdigit((unsigned char)s[i])) i++, digits++;
  if (i < s.size() && s[i] == '.') {
    i++;
    while (i < s.size() && std::isdigit((unsigned char)s[i])) i++, digits++;
  }
  if (digits == 0) return 0;
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    size_t j = i + 1;
    if (j < s.size() && (s[j] == '+' || s[j] == '-')) j++;
    size_t exp_digits = 0;
    while (j < s.size() && std::isdigit((unsigned char)s[j])) j++, exp_digits++;
    if (exp_digits > 0) i = j;  // else the 'e' is left for the unit, which will refuse it
  }
  return i;
}

// value = number * unit, the unit one of `units` or, when absent, `bare`'s scale. False on
// anything else, or when the result is not finite.
bool parse_quantity(const std::string& text, const Unit* units, size_t n_units, double bare,
                    double* value) {
  const size_t len = number_length(text);
  if (len == 0) return false;
  const double x = std::strtod(text.substr(0, len).c_str(), nullptr);
  const std::string unit = text.substr(len);
  double scale = unit.empty() ? bare : 0;
  for (size_t i = 0; i < n_units && scale == 0; i++)
    if (unit == units[i].name) scale = units[i].scale;
  if (scale == 0) return false;
  *value = x * scale;
  return std::isfinite(*value);
}

// x with up to six significant digits and no trailing zeros: "160", "1.5", "0.25".
std::string num(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

std::string bandwidth_text(double bytes_per_s) {
  for (const Unit& u : kBandwidthUnits)
    if (bytes_per_s >= u.scale) return num(bytes_per_s / u.scale) + " " + u.name;
  return num(bytes_per_s) + " B/s";
}

std::string time_text(double s) {
  if (s == 0) return "0 us";
  for (const Unit& u : kTimeUnits)
    if (s >= u.scale) return num(s / u.scale) + " " + u.name;
  return num(s / 1e-9) + " ns";
}

}  // namespace

bool parse_link(const std::string& spec, LinkModel* out, std::string* error) {
  auto fail = [&](const std::string& why) {
    if (error) *error = "--link: " + why;
    return false;
  };
  const std::string want = "want intra=BW,inter=BW,latency=T (any of them, each once)";
  if (spec.empty()) return fail("empty; " + want);
  std::vector<std::string> parts;
  for (size_t start = 0;;) {
    const size_t comma = spec.find(',', start);
    parts.push_back(spec.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  LinkModel m = *out;
  m.intra_bytes_per_s = LinkModel().intra_bytes_per_s;
  m.inter_bytes_per_s = LinkModel().inter_bytes_per_s;
  m.latency_s = LinkModel().latency_s;
  bool seen_intra = false, seen_inter = false, seen_latency = false;
  for (const std::string& part : parts) {
    if (part.empty()) return fail("empty part in '" + spec + "'; " + want);
    const size_t eq = part.find('=');
    if (eq == std::string::npos)
      return fail("'" + part + "': not key=value; " + want);
    const std::string key = part.substr(0, eq), value = part.substr(eq + 1);
    bool* seen = key == "intra" ? &seen_intra : key == "inter" ? &seen_inter
               : key == "latency" ? &seen_latency : nullptr;
    if (!seen) return fail("'" + part + "': unknown key '" + key + "'; the keys are intra, inter and latency");
    if (*seen) return fail("'" + part + "': " + key + " is given twice; each key at most once");
    *seen = true;
    if (key == "latency") {
      double t = 0;
      if (!parse_quantity(value, kTimeUnits, 4, 1e-6, &t))
        return fail("'" + part + "': latency must be a non-negative number with unit s, ms, us or ns");
      m.latency_s = t;
    } else {
      double bw = 0;
      if (!parse_quantity(value, kBandwidthUnits, 4, 1e9, &bw) || !(bw > 0))
        return fail("'" + part + "': bandwidth must be a positive number with unit GB/s, MB/s, KB/s or B/s");
      (key == "intra" ? m.intra_bytes_per_s : m.inter_bytes_per_s) = bw;
    }
  }
  m.enabled = true;
  *out = m;
  return true;
}

std::string describe(const LinkModel& m) {
  const std::string per_node = std::to_string(m.ranks_per_node) +
                               (m.ranks_per_node == 1 ? " rank per " : " ranks per ") +
                               (m.real_nodes ? "node" : "virtual node");
  if (!m.enabled) return "links not modelled (" + per_node + ")";
  return "modelled links: intra-node " + bandwidth_text(m.intra_bytes_per_s) + ", inter-node " +
         bandwidth_text(m.inter_bytes_per_s) + ", latency " + time_text(m.latency_s) + ", " +
         per_node;
}

using namespace detail;

// ----------------------------------------------------------------------------
// the link model (see comm.h): process-wide, like the links it stands for

namespace {
struct LinkState {
  LinkModel model;
  // when each link of this rank is next free, on link_now_s()'s clock: [0] intra, [1] inter
  double out_free_s[2] = {0, 0}, in_free_s[2] = {0, 0};
  LinkBytes sent;
};
LinkState g_link;
}  // namespace

// The model's clock: seconds on steady_clock since the first call (the Backoff's clock too).
double detail::link_now_s() {
  using clock = std::chrono::steady_clock;
  static const clock::time_point epoch = clock::now();
  return std::chrono::duration<double>(clock::now() - epoch).count();
}

void Comm::set_link(const LinkModel& m) {
  FF_CHECK(std::isfinite(m.intra_bytes_per_s) && m.intra_bytes_per_s > 0 &&
               std::isfinite(m.inter_bytes_per_s) && m.inter_bytes_per_s > 0,
           "link model: bandwidths must be positive and finite, got intra "
               << m.intra_bytes_per_s << " and inter " << m.inter_bytes_per_s << " bytes/s");
  FF_CHECK(std::isfinite(m.latency_s) && m.latency_s >= 0,
           "link model: latency must be non-negative and finite, got " << m.latency_s << " s");
  FF_CHECK(m.ranks_per_node >= 1, "link model: ranks_per_node must be at least 1, got " << m.ranks_per_node);
  LinkState fresh;
  fresh.model = m;
  fresh.sent = g_link.sent;  // the counters run on; reset_bytes_sent() clears them
  g_link = fresh;
}

const LinkModel& Comm::link() { return g_link.model; }
double Comm::link_clock_s() { return link_now_s(); }
LinkBytes Comm::bytes_sent() { return g_link.sent; }
void Comm::reset_bytes_sent() { g_link.sent = LinkBytes{}; }

int Comm::world_rank(int r) const {
  FF_CHECK(r >= 0 && r < size_, "world_rank: rank " << r << " is not in this communicator of " << size_);
  return world_ranks_ ? (*world_ranks_)[(size_t)r] : r;
}

LinkClass Comm::link_class(int peer) const {
  FF_CHECK(peer >= 0 && peer < size_,
           "link_class: peer " << peer << " is not a rank of this communicator of " << size_);
  if (peer == rank_) return LinkClass::self;
  const LinkModel& m = g_link.model;
  return m.node_of(world_rank(peer)) == m.node_of(world_rank(rank_)) ? LinkClass::intra
                                                                      : LinkClass::inter;
}

// The message of `bytes` on the link of class c whose next free time is *free_s, from t:
// it starts when both it and the link are ready, holds the link bytes / bandwidth, and is
// complete one latency later. Returns that completion.
static double charge_link(double* free_s, LinkClass c, size_t bytes, double t) {
  const LinkModel& m = g_link.model;
  const double bandwidth = c == LinkClass::intra ? m.intra_bytes_per_s : m.inter_bytes_per_s;
  const double start = std::max(t, *free_s);
  *free_s = start + (double)bytes / bandwidth;
  return *free_s + m.latency_s;
}
static int link_index(LinkClass c) { return c == LinkClass::intra ? 0 : 1; }

// A send just posted: its bytes counted by class; with the model on, its modelled completion.
void Comm::link_posted(Request& r) {
  if (r.peer < 0 || r.peer >= size_) return;  // MPI_PROC_NULL: nothing is sent
  CollectiveCount& sent = (*counts_)["send"];  // point-to-point, next to the collectives
  sent.calls++;
  sent.bytes += r.bytes;
  const LinkClass c = link_class(r.peer);
  (c == LinkClass::self ? g_link.sent.self : c == LinkClass::intra ? g_link.sent.intra
                                                                   : g_link.sent.inter) += r.bytes;
  if (!g_link.model.enabled || c == LinkClass::self || r.nccl) return;  // NCCL's are not modelled
  r.modelled = true;
  r.link_done_s = charge_link(&g_link.out_free_s[link_index(c)], c, r.bytes, link_now_s());
}

void Comm::link_collective(Request& r, int steps, size_t chunk) {
  if (!g_link.model.enabled || r.nccl || steps <= 0) return;  // NCCL's are not modelled
  LinkClass c = LinkClass::intra;
  for (int p = 0; p < size_; p++)
    if (link_class(p) == LinkClass::inter) c = LinkClass::inter;
  const double now = link_now_s();
  double done = now;
  for (int s = 0; s < steps; s++)  // each step's message after the one before it
    done = charge_link(&g_link.out_free_s[link_index(c)], c, chunk, done);
  const LinkModel& m = g_link.model;
  r.link_cost_s = steps * ((double)chunk / (c == LinkClass::intra ? m.intra_bytes_per_s : m.inter_bytes_per_s) +
                           m.latency_s);
  r.modelled = true;
  r.link_done_s = done;
}

// A modelled receive a wait has just seen complete in MPI: its incoming link is charged from
// now (the source, for a wildcard receive, as the status says).
void Comm::link_arrived(Request& r, const MPI_Status& status) {
  if (!r.modelled || !r.is_recv || r.link_done_s >= 0) return;
  const int src = r.peer == MPI_ANY_SOURCE ? status.MPI_SOURCE : r.peer;
  if (!g_link.model.enabled || src < 0 || src >= size_ || src == rank_) {
    r.modelled = false;
    return;
  }
  const LinkClass c = link_class(src);
  r.link_done_s = charge_link(&g_link.in_free_s[link_index(c)], c, r.bytes, link_now_s());
}

// Whether r is done as far as the model goes (a receive not yet seen in MPI is not).
bool detail::link_due(const Request& r, double now_s) {
  return !r.modelled || (r.link_done_s >= 0 && now_s >= r.link_done_s);
}


}  // namespace ff
